"""The placer's planner, sans-I/O: path choice (G5, G6, G19), network scope (G4), one member
per machine (G3), the qualification table (G21)."""

from __future__ import annotations

import ipaddress

from libs.contracts.errors import ErrorCode
from libs.contracts.jobs import PathClass
from services.placer.addresses import MESH_NETWORK
from tests.planner_support import (
    BASE_CAPS,
    auto,
    codes,
    config,
    container,
    direct,
    must_not_place,
    must_place,
    private_vm,
    vm,
)

# -- path choice (G5, G6, G19) -------------------------------------------------------------------


def test_private_path_preferred_when_all_members_share_a_provider_region_private_network() -> None:
    records = [
        private_vm("a", "10.0.0.1", "172.16.0.1"),
        private_vm("b", "10.0.0.2", "172.16.0.2"),
        private_vm("c", "10.0.0.3", "172.16.0.3"),
    ]
    plan = must_place(direct(3), records)
    assert plan.path is PathClass.PRIVATE
    assert [m.address for m in plan.members] == ["172.16.0.1", "172.16.0.2", "172.16.0.3"]
    assert {m.interface for m in plan.members} == {"eth1"}  # the private interface (G8)


def test_private_path_uses_each_members_private_interface() -> None:
    records = [
        private_vm("a", "10.0.0.1", "172.16.0.1", privateInterface="ens5"),
        private_vm("b", "10.0.0.2", "172.16.0.2", privateInterface="ens6"),
    ]
    plan = must_place(direct(), records)
    assert plan.path is PathClass.PRIVATE
    assert [m.interface for m in plan.members] == ["ens5", "ens6"]


def test_private_path_preferred_over_direct_even_when_direct_members_come_first() -> None:
    records = [
        vm("d1", "10.0.0.1"),
        vm("d2", "10.0.0.2"),
        private_vm("p1", "10.0.0.3", "172.16.0.3"),
        private_vm("p2", "10.0.0.4", "172.16.0.4"),
    ]
    plan = must_place(auto(), records)
    assert plan.path is PathClass.PRIVATE
    assert plan.nodes == ["p1", "p2"]


def test_private_path_needs_one_private_network() -> None:
    records = [
        private_vm("a", "10.0.0.1", "172.16.0.1", network="vpc-a"),
        private_vm("b", "10.0.0.2", "172.16.0.2", network="vpc-b"),
    ]
    plan = must_place(direct(), records)
    assert plan.path is PathClass.DIRECT


def test_private_path_needs_one_provider_region_even_with_the_same_network_name() -> None:
    records = [
        private_vm("a", "10.0.0.1", "172.16.0.1", region="us-east-1"),
        private_vm("b", "10.0.0.2", "172.16.0.2", region="us-west-2"),
    ]
    assert must_place(direct(), records).path is PathClass.DIRECT
    records = [
        private_vm("a", "10.0.0.1", "172.16.0.1", provider="aws"),
        private_vm("b", "10.0.0.2", "172.16.0.2", provider="gcp"),
    ]
    assert must_place(direct(), records).path is PathClass.DIRECT


def test_private_path_refuses_duplicate_private_addresses() -> None:
    records = [
        private_vm("a", "10.0.0.1", "172.16.0.1"),
        private_vm("b", "10.0.0.2", "172.16.0.1"),
    ]
    plan = must_place(direct(), records)
    assert plan.path is PathClass.DIRECT  # not two members at 172.16.0.1 (C4)


def test_private_path_picks_members_with_distinct_private_addresses() -> None:
    records = [
        private_vm("a", "10.0.0.1", "172.16.0.1"),
        private_vm("b", "10.0.0.2", "172.16.0.1"),
        private_vm("c", "10.0.0.3", "172.16.0.3"),
    ]
    plan = must_place(direct(), records)
    assert plan.path is PathClass.PRIVATE
    assert plan.nodes == ["a", "c"]


def test_direct_path_for_vms_without_a_shared_private_network() -> None:
    records = [vm("a", "10.0.0.1", provider="aws"), vm("b", "10.1.0.1", provider="gcp")]
    plan = must_place(direct(), records)
    assert plan.path is PathClass.DIRECT
    assert {m.interface for m in plan.members} == {"nodus0"}


def test_direct_path_needs_every_member_to_be_a_vm() -> None:
    records = [vm("a", "10.0.0.1"), container("c", "10.0.0.2")]
    shortfalls = must_not_place(direct(), records)
    assert PathClass.RELAYED not in codes(shortfalls)  # transport Direct never tries Relayed (G5)


def test_direct_path_needs_the_wireguard_device_capability() -> None:
    records = [vm("a", "10.0.0.1", caps=BASE_CAPS), vm("b", "10.0.0.2", caps=BASE_CAPS)]
    shortfalls = must_not_place(direct(), records)
    assert codes(shortfalls)[PathClass.DIRECT] is ErrorCode.MISSING_CAPABILITY
    message = next(s.message for s in shortfalls if s.path is PathClass.DIRECT)
    assert "wireguard-device" in message


def test_direct_path_skips_a_vm_lacking_wireguard_and_uses_the_others() -> None:
    records = [vm("a", "10.0.0.1", caps=BASE_CAPS), vm("b", "10.0.0.2"), vm("c", "10.0.0.3")]
    plan = must_place(direct(), records)
    assert plan.path is PathClass.DIRECT
    assert plan.nodes == ["b", "c"]


def test_direct_addresses_are_distinct_mesh_addresses_whatever_the_eth0_addresses() -> None:
    # Direct advertises mesh addresses, so identical eth0 addresses (NAT) do not matter.
    records = [vm(f"m{i}", "10.0.0.1") for i in range(8)]
    plan = must_place(direct(8), records, mesh_id="deadbeef" + "0" * 24)
    assert plan.path is PathClass.DIRECT
    addresses = [m.address for m in plan.members]
    assert len(set(addresses)) == 8
    assert all(ipaddress.ip_address(a) in MESH_NETWORK for a in addresses)


def test_relayed_path_for_a_container_member_with_transport_auto() -> None:
    records = [vm("a", "10.0.0.1"), container("c", "10.0.0.2")]
    plan = must_place(auto(), records)
    assert plan.path is PathClass.RELAYED
    assert [m.address for m in plan.members] == ["10.0.0.1", "10.0.0.2"]  # their eth0 (G7)
    assert {m.interface for m in plan.members} == {"eth0"}


def test_relayed_path_between_two_containers() -> None:
    records = [container("c1", "10.0.0.1"), container("c2", "10.0.0.2")]
    assert must_place(auto(), records).path is PathClass.RELAYED


def test_relayed_path_never_with_transport_direct() -> None:
    records = [container("c1", "10.0.0.1"), container("c2", "10.0.0.2")]
    shortfalls = must_not_place(direct(), records)
    assert PathClass.RELAYED not in codes(shortfalls)


def test_relayed_path_not_chosen_when_direct_is_possible() -> None:
    records = [container("c1", "10.0.0.1"), vm("a", "10.0.0.2"), vm("b", "10.0.0.3")]
    plan = must_place(auto(), records)
    assert plan.path is PathClass.DIRECT  # G19: Relayed is assumed 4x slower
    assert plan.nodes == ["a", "b"]


def test_relayed_path_never_for_a_gang_of_vms_only() -> None:
    # VMs whose agents cannot create the WireGuard device, even with vm+vm qualified for Relayed.
    cfg = config()
    cfg.qualified.relayed = ["*+*"]
    records = [vm("a", "10.0.0.1", caps=BASE_CAPS), vm("b", "10.0.0.2", caps=BASE_CAPS)]
    shortfalls = must_not_place(auto(), records, cfg=cfg)
    assert PathClass.RELAYED in codes(shortfalls)


def test_relayed_gangs_have_at_most_relayed_max_members() -> None:
    records = [container(f"c{i}", f"10.0.0.{i + 1}") for i in range(3)]
    shortfalls = must_not_place(auto(3), records)
    assert codes(shortfalls)[PathClass.RELAYED] is ErrorCode.RELAYED_MEMBERS
    message = next(s.message for s in shortfalls if s.path is PathClass.RELAYED)
    assert "2" in message and "3" in message


def test_relayed_member_limit_is_a_setting() -> None:
    records = [container(f"c{i}", f"10.0.0.{i + 1}") for i in range(3)]
    plan = must_place(auto(3), records, cfg=config(relayed_max_members=3))
    assert plan.path is PathClass.RELAYED
    assert len(plan.members) == 3


def test_relayed_member_limit_does_not_stop_a_direct_gang() -> None:
    records = [vm(f"m{i}", f"10.0.0.{i + 1}") for i in range(4)]
    plan = must_place(auto(4), records)
    assert plan.path is PathClass.DIRECT


# -- network scope (G4) -------------------------------------------------------------------------


def test_colocated_keeps_members_in_one_provider_region() -> None:
    records = [
        vm("a", "10.0.0.1", region="us-east-1"),
        vm("b", "10.0.0.2", region="us-west-2"),
        vm("c", "10.0.0.3", region="us-east-1"),
    ]
    plan = must_place(direct(2, "Colocated"), records)
    assert plan.nodes == ["a", "c"]
    must_not_place(direct(3, "Colocated"), records)


def test_colocated_distinguishes_providers_with_the_same_region_name() -> None:
    records = [vm("a", "10.0.0.1", provider="aws"), vm("b", "10.0.0.2", provider="gcp")]
    must_not_place(direct(2, "Colocated"), records)
    assert must_place(direct(2, "Regional"), records).path is PathClass.DIRECT


def test_regional_allows_any_provider_inside_one_region_class() -> None:
    records = [
        vm("a", "10.0.0.1", provider="aws", region="us-east-1", regionClass="us"),
        vm("b", "10.0.0.2", provider="gcp", region="us-central1", regionClass="us"),
        vm("c", "10.0.0.3", provider="azure", region="westeurope", regionClass="eu"),
    ]
    plan = must_place(direct(2, "Regional"), records)
    assert plan.nodes == ["a", "b"]
    must_not_place(direct(3, "Regional"), records)


def test_global_allows_anywhere() -> None:
    records = [
        vm("a", "10.0.0.1", provider="aws", region="us-east-1", regionClass="us"),
        vm("b", "10.0.0.2", provider="gcp", region="europe-west4", regionClass="eu"),
        vm("c", "10.0.0.3", provider="azure", region="japaneast", regionClass="ap"),
    ]
    plan = must_place(direct(3, "Global"), records)
    assert sorted(plan.nodes) == ["a", "b", "c"]


def test_relayed_respects_the_network_scope() -> None:
    records = [
        vm("a", "10.0.0.1", region="us-east-1", caps=BASE_CAPS),
        container("c", "10.0.0.2", region="us-west-2"),
    ]
    must_not_place(auto(2, "Colocated"), records)
    assert must_place(auto(2, "Regional"), records).path is PathClass.RELAYED


# -- one member per machine, all at once (G3) ---------------------------------------------------


def test_one_member_per_machine_and_the_exact_member_count() -> None:
    records = [vm(f"m{i}", f"10.0.0.{i + 1}") for i in range(5)]
    for members in range(2, 6):
        plan = must_place(direct(members), records)
        assert len(plan.members) == members
        assert len(set(plan.nodes)) == members
        assert [m.rank for m in plan.members] == list(range(members))


def test_too_few_machines_is_no_plan_at_all() -> None:
    records = [vm(f"m{i}", f"10.0.0.{i + 1}") for i in range(3)]
    shortfalls = must_not_place(direct(4), records)
    assert codes(shortfalls)[PathClass.DIRECT] is ErrorCode.UNSATISFIABLE
    message = next(s.message for s in shortfalls if s.path is PathClass.DIRECT)
    assert "4" in message and "3" in message


def test_ranks_follow_node_names_whatever_the_view_order() -> None:
    records = [vm("zeta", "10.0.0.1"), vm("alpha", "10.0.0.2"), vm("mid", "10.0.0.3")]
    plan = must_place(direct(3), records)
    assert plan.nodes == ["alpha", "mid", "zeta"]
    again = must_place(direct(3), list(reversed(records)))
    assert again == plan


# -- qualification table (G21) ------------------------------------------------------------------


def test_direct_only_on_qualified_provider_pairs() -> None:
    cfg = config()
    cfg.qualified.direct = ["aws/vm+gcp/vm"]
    same = [vm("a1", "10.0.0.1", provider="aws"), vm("a2", "10.0.0.2", provider="aws")]
    shortfalls = must_not_place(direct(), same, cfg=cfg)
    assert "aws/vm+gcp/vm" in next(s.message for s in shortfalls if s.path is PathClass.DIRECT)
    mixed = [vm("a1", "10.0.0.1", provider="aws"), vm("g1", "10.0.0.2", provider="gcp")]
    assert must_place(direct(), mixed, cfg=cfg).path is PathClass.DIRECT


def test_pair_patterns_match_in_either_order() -> None:
    cfg = config()
    cfg.qualified.direct = ["gcp/vm+aws/vm"]
    mixed = [vm("a1", "10.0.0.1", provider="aws"), vm("g1", "10.0.0.2", provider="gcp")]
    assert must_place(direct(), mixed, cfg=cfg).path is PathClass.DIRECT


def test_provider_wildcard_pattern() -> None:
    cfg = config()
    cfg.qualified.direct = ["aws/vm+*"]
    gcp_pair = [vm("g1", "10.0.0.1", provider="gcp"), vm("g2", "10.0.0.2", provider="gcp")]
    must_not_place(direct(), gcp_pair, cfg=cfg)
    with_aws = [vm("a1", "10.0.0.1", provider="aws"), vm("g1", "10.0.0.2", provider="gcp")]
    assert must_place(direct(), with_aws, cfg=cfg).path is PathClass.DIRECT


def test_every_pair_of_the_gang_must_be_qualified() -> None:
    cfg = config()
    cfg.qualified.direct = ["aws/vm+*"]
    # a1-g1 and a1-z1 are qualified, g1-z1 is not: no 3-member gang.
    records = [
        vm("a1", "10.0.0.1", provider="aws"),
        vm("g1", "10.0.0.2", provider="gcp"),
        vm("z1", "10.0.0.3", provider="azure"),
    ]
    must_not_place(direct(3), records, cfg=cfg)
    records.append(vm("a2", "10.0.0.4", provider="aws"))
    plan = must_place(direct(3), records, cfg=cfg)
    assert sum(1 for n in plan.nodes if n.startswith("a")) >= 2


def test_relayed_container_plus_vm_only() -> None:
    cfg = config()
    cfg.qualified.relayed = ["container+vm"]
    containers = [container("c1", "10.0.0.1"), container("c2", "10.0.0.2")]
    must_not_place(auto(), containers, cfg=cfg)
    mixed = [container("c1", "10.0.0.1"), vm("v1", "10.0.0.2", caps=BASE_CAPS)]
    assert must_place(auto(), mixed, cfg=cfg).path is PathClass.RELAYED


def test_default_table_does_not_qualify_containers_for_private() -> None:
    records = [
        container("c1", "10.0.0.1", privateNetwork="vpc-a", privateAddress="172.16.0.1"),
        container("c2", "10.0.0.2", privateNetwork="vpc-a", privateAddress="172.16.0.2"),
    ]
    plan = must_place(auto(), records)
    assert plan.path is PathClass.RELAYED


def test_empty_qualification_list_refuses_the_path_with_not_qualified() -> None:
    cfg = config()
    cfg.qualified.direct = []
    cfg.qualified.private = []
    records = [vm("a", "10.0.0.1"), vm("b", "10.0.0.2")]
    shortfalls = must_not_place(direct(), records, cfg=cfg)
    assert codes(shortfalls)[PathClass.DIRECT] is ErrorCode.NOT_QUALIFIED

"""The placer's planner, sans-I/O: path choice (G5, G6, G19), scopes (G4), qualification (G21),
advertised addresses (G7, C4), one backend (C5), capabilities (C6), accelerators, exclusions."""

from __future__ import annotations

import ipaddress
from typing import Any

import pytest

from libs.contracts.errors import ErrorCode
from libs.contracts.fleet import NodeRecord
from libs.contracts.jobs import Job, PathClass
from services.placer.config import PlacerConfig, load_config
from services.placer.planner import (
    MESH_NETWORK,
    Exclusions,
    Plan,
    PlannedMember,
    Planner,
    Shortfall,
    address_problem,
    check_plan,
    mesh_addresses,
)
from tests.factories import job, machine, node_record

BASE_CAPS = ["register", "heartbeat", "join-epoch"]
VM_CAPS = [*BASE_CAPS, "wireguard-device"]


# -- builders ----------------------------------------------------------------------------------


def config(**changes: Any) -> PlacerConfig:
    """The shipped default config with some fields changed."""
    cfg = load_config()
    for name, value in changes.items():
        setattr(cfg, name, value)
    return cfg


def vm(
    name: str, address: str, namespace: str = "ns-1", caps: list[str] | None = None, **fields: Any
) -> NodeRecord:
    return node_record(
        machine(name, address=address, **fields), capabilities=caps, namespace=namespace
    )


def container(
    name: str, address: str, namespace: str = "ns-1", caps: list[str] | None = None, **fields: Any
) -> NodeRecord:
    return node_record(
        machine(name, offering="container", address=address, **fields),
        capabilities=caps,
        namespace=namespace,
    )


def private_vm(
    name: str, address: str, private: str, network: str = "vpc-a", **fields: Any
) -> NodeRecord:
    return vm(name, address, privateNetwork=network, privateAddress=private, **fields)


def auto(members: int = 2, network: str = "Global", **spec: Any) -> Job:
    return job(distributed={"members": members, "network": network, "transport": "Auto"}, **spec)


def direct(members: int = 2, network: str = "Global", **spec: Any) -> Job:
    return job(distributed={"members": members, "network": network, "transport": "Direct"}, **spec)


def place(
    the_job: Job,
    records: list[NodeRecord],
    cfg: PlacerConfig | None = None,
    exclusions: Exclusions | None = None,
    mesh_id: str = "0" * 32,
) -> tuple[Plan | None, list[Shortfall]]:
    plan, shortfalls = Planner(cfg or config()).plan(the_job, records, exclusions, mesh_id)
    if plan is not None:
        problems = check_plan(plan, {r.inventory.node: r for r in records}, the_job)
        assert problems == [], problems
    return plan, shortfalls


def must_place(the_job: Job, records: list[NodeRecord], **kwargs: Any) -> Plan:
    plan, shortfalls = place(the_job, records, **kwargs)
    assert plan is not None, shortfalls
    return plan


def must_not_place(the_job: Job, records: list[NodeRecord], **kwargs: Any) -> list[Shortfall]:
    plan, shortfalls = place(the_job, records, **kwargs)
    assert plan is None, plan
    assert shortfalls, "a refusal must say why"
    assert all(s.message for s in shortfalls)
    return shortfalls


def codes(shortfalls: list[Shortfall]) -> dict[PathClass, ErrorCode]:
    return {s.path: s.code for s in shortfalls}


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


# -- advertised addresses (G7, C4) --------------------------------------------------------------


@pytest.mark.parametrize("bad", ["0.0.0.0", "::", "not-an-ip", "224.0.0.1"])
def test_relayed_never_uses_an_unusable_address(bad: str) -> None:
    records = [container("c1", bad), container("c2", "10.0.0.2"), container("c3", "10.0.0.3")]
    plan = must_place(auto(), records)
    assert "c1" not in plan.nodes
    must_not_place(auto(), records[:2])


def test_private_never_uses_an_unspecified_private_address() -> None:
    records = [
        private_vm("a", "10.0.0.1", "0.0.0.0"),
        private_vm("b", "10.0.0.2", "172.16.0.2"),
    ]
    plan = must_place(direct(), records)
    assert plan.path is PathClass.DIRECT
    assert "0.0.0.0" not in [m.address for m in plan.members]


def test_loopback_addresses_only_inside_one_network_namespace() -> None:
    same = [
        container("c1", "127.0.0.2", namespace="host-a"),
        container("c2", "127.0.0.3", namespace="host-a"),
    ]
    plan = must_place(auto(), same)
    assert [m.address for m in plan.members] == ["127.0.0.2", "127.0.0.3"]
    spans = [
        container("c1", "127.0.0.2", namespace="host-a"),
        container("c2", "127.0.0.3", namespace="host-b"),
    ]
    must_not_place(auto(), spans)


def test_loopback_address_without_a_known_namespace_is_not_used() -> None:
    records = [
        container("c1", "127.0.0.2", namespace=""),
        container("c2", "127.0.0.3", namespace=""),
    ]
    must_not_place(auto(), records)


def test_loopback_is_not_mixed_with_another_namespace_when_a_choice_exists() -> None:
    records = [
        container("c1", "127.0.0.2", namespace="host-a"),
        container("c2", "127.0.0.3", namespace="host-b"),
        container("c3", "127.0.0.4", namespace="host-b"),
    ]
    plan = must_place(auto(), records)
    assert plan.nodes == ["c2", "c3"]


def test_relayed_advertised_addresses_are_distinct_within_a_gang() -> None:
    records = [container("c1", "10.0.0.1"), container("c2", "10.0.0.1")]
    must_not_place(auto(), records)
    records.append(container("c3", "10.0.0.3"))
    plan = must_place(auto(), records)
    addresses = [m.address for m in plan.members]
    assert len(set(addresses)) == 2 and "10.0.0.3" in addresses


def test_ipv4_mapped_loopback_is_loopback() -> None:
    # C4: ::ffff:127.0.0.1 is 127.0.0.1; two members in different namespaces must not be told
    # to meet there.
    records = [
        container("c1", "::ffff:127.0.0.1", namespace="host-a"),
        container("c2", "10.0.0.2", namespace="host-b"),
    ]
    must_not_place(auto(), records)


@pytest.mark.parametrize(
    "address", ["0.0.0.0", "::", "::ffff:0.0.0.0", "ff02::1", "224.0.0.251", "10.0.0.300", ""]
)
def test_address_problem_flags_non_unicast_addresses(address: str) -> None:
    assert address_problem(address) is not None


@pytest.mark.parametrize(
    "address", ["10.0.0.1", "192.168.1.20", "100.64.0.7", "fd00::1", "127.0.0.1"]
)
def test_address_problem_accepts_unicast_addresses(address: str) -> None:
    # loopback is an address problem only across namespaces, which the planner checks
    assert address_problem(address) is None


def test_a_gang_does_not_mix_ip_families() -> None:
    # One NCCL_SOCKET_FAMILY is fixed for the whole gang (G8): members advertised on IPv4 and
    # IPv6 at once cannot all be reached with it.
    records = [container("c1", "10.0.0.1"), container("c2", "fd00::2")]
    must_not_place(auto(), records)


# -- mesh addresses -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mesh_id", ["0" * 32, "f" * 32, "deadbeef" * 4, "0000ffff" + "a" * 24, "12345678"]
)
def test_mesh_addresses_are_distinct_and_inside_100_64_0_0_10(mesh_id: str) -> None:
    addresses = mesh_addresses(mesh_id, 8)
    assert len(addresses) == 8
    assert len(set(addresses)) == 8
    for address in addresses:
        ip = ipaddress.ip_address(address)
        assert ip in MESH_NETWORK
        assert address_problem(address) is None
        assert str(ip).split(".")[-1] not in ("0", "255")  # not a network or broadcast address


def test_mesh_addresses_differ_between_epochs_with_different_mesh_ids() -> None:
    assert mesh_addresses("00000001" + "0" * 24, 2) != mesh_addresses("00000002" + "0" * 24, 2)


def test_direct_plan_uses_the_epochs_mesh_id() -> None:
    records = [vm("a", "10.0.0.1"), vm("b", "10.0.0.2")]
    mesh_id = "0000abcd" + "0" * 24
    plan = must_place(direct(), records, mesh_id=mesh_id)
    assert [m.address for m in plan.members] == mesh_addresses(mesh_id, 2)


# -- one accelerator backend (C5) ---------------------------------------------------------------


def test_members_share_one_accelerator_backend() -> None:
    records = [
        vm("a", "10.0.0.1", accelerators={"count": 8, "backend": "cuda", "model": "H100"}),
        vm("b", "10.0.0.2", accelerators={"count": 8, "backend": "rocm", "model": "MI300X"}),
    ]
    must_not_place(direct(), records)
    records.append(
        vm("c", "10.0.0.3", accelerators={"count": 8, "backend": "rocm", "model": "MI300X"})
    )
    plan = must_place(direct(), records)
    assert plan.nodes == ["b", "c"]


def test_one_backend_on_the_relayed_path_too() -> None:
    records = [
        container("c1", "10.0.0.1", accelerators={"count": 1, "backend": "cuda", "model": "L4"}),
        container("c2", "10.0.0.2", accelerators={"count": 1, "backend": "rocm", "model": "MI210"}),
    ]
    must_not_place(auto(), records)


def test_one_backend_on_the_private_path_too() -> None:
    records = [
        private_vm(
            "a",
            "10.0.0.1",
            "172.16.0.1",
            accelerators={"count": 8, "backend": "cuda", "model": "H100"},
        ),
        private_vm(
            "b",
            "10.0.0.2",
            "172.16.0.2",
            accelerators={"count": 8, "backend": "rocm", "model": "MI300X"},
        ),
    ]
    must_not_place(direct(), records)


# -- capabilities (C6) --------------------------------------------------------------------------


def test_a_node_lacking_a_required_capability_is_not_used() -> None:
    records = [
        vm("old", "10.0.0.1", caps=["register", "heartbeat"]),
        vm("b", "10.0.0.2"),
        vm("c", "10.0.0.3"),
    ]
    plan = must_place(direct(), records)
    assert "old" not in plan.nodes


def test_a_fleet_lacking_a_capability_is_refused_with_missing_capability() -> None:
    records = [vm("a", "10.0.0.1", caps=["register"]), vm("b", "10.0.0.2", caps=["register"])]
    shortfalls = must_not_place(direct(), records)
    assert codes(shortfalls)[PathClass.DIRECT] is ErrorCode.MISSING_CAPABILITY
    assert "join-epoch" in next(s.message for s in shortfalls if s.path is PathClass.DIRECT)


def test_missing_capability_on_every_path_of_an_auto_job() -> None:
    records = [
        private_vm("a", "10.0.0.1", "172.16.0.1", caps=[]),
        container("c", "10.0.0.2", caps=[]),
        private_vm("b", "10.0.0.3", "172.16.0.3", caps=[]),
    ]
    shortfalls = must_not_place(auto(), records)
    assert codes(shortfalls) == {
        PathClass.PRIVATE: ErrorCode.MISSING_CAPABILITY,
        PathClass.DIRECT: ErrorCode.MISSING_CAPABILITY,
        PathClass.RELAYED: ErrorCode.MISSING_CAPABILITY,
    }


def test_configured_path_capability_is_required_on_that_path_only() -> None:
    cfg = config()
    cfg.required_capabilities.relayed = ["socks5"]
    records = [container("c1", "10.0.0.1"), container("c2", "10.0.0.2")]
    shortfalls = must_not_place(auto(), records, cfg=cfg)
    assert codes(shortfalls)[PathClass.RELAYED] is ErrorCode.MISSING_CAPABILITY
    capable = [
        container("c1", "10.0.0.1", caps=[*BASE_CAPS, "socks5"]),
        container("c2", "10.0.0.2", caps=[*BASE_CAPS, "socks5"]),
    ]
    assert must_place(auto(), capable, cfg=cfg).path is PathClass.RELAYED
    # and the VMs of a Direct gang do not need it
    assert (
        must_place(direct(), [vm("a", "10.0.0.1"), vm("b", "10.0.0.2")], cfg=cfg).path
        is PathClass.DIRECT
    )


# -- accelerators ------------------------------------------------------------------------------


def test_accelerator_count_is_at_least() -> None:
    records = [
        vm("small", "10.0.0.1", accelerators={"count": 2, "backend": "cuda", "model": "H100"}),
        vm("b", "10.0.0.2", accelerators={"count": 4, "backend": "cuda", "model": "H100"}),
        vm("c", "10.0.0.3", accelerators={"count": 8, "backend": "cuda", "model": "H100"}),
    ]
    plan = must_place(direct(accelerators={"count": 4}), records)
    assert plan.nodes == ["b", "c"]


def test_accelerator_backend_and_model_are_equal_where_given() -> None:
    records = [
        vm("h1", "10.0.0.1", accelerators={"count": 8, "backend": "cuda", "model": "H100"}),
        vm("a1", "10.0.0.2", accelerators={"count": 8, "backend": "cuda", "model": "A100"}),
        vm("h2", "10.0.0.3", accelerators={"count": 8, "backend": "cuda", "model": "H100"}),
        vm("m1", "10.0.0.4", accelerators={"count": 8, "backend": "rocm", "model": "MI300X"}),
        vm("m2", "10.0.0.5", accelerators={"count": 8, "backend": "rocm", "model": "MI300X"}),
    ]
    assert must_place(direct(accelerators={"model": "H100"}), records).nodes == ["h1", "h2"]
    assert must_place(direct(accelerators={"backend": "rocm"}), records).nodes == ["m1", "m2"]
    must_not_place(direct(accelerators={"backend": "cuda", "model": "MI300X"}), records)


def test_no_machine_with_the_accelerators_is_unsatisfiable_and_says_what_was_asked() -> None:
    records = [vm("a", "10.0.0.1"), vm("b", "10.0.0.2")]
    shortfalls = must_not_place(
        direct(accelerators={"count": 2, "backend": "rocm", "model": "MI300X"}), records
    )
    assert shortfalls[0].code is ErrorCode.UNSATISFIABLE
    assert "2x rocm MI300X" in shortfalls[0].message


def test_zero_accelerators_asked_accepts_any_machine() -> None:
    records = [
        vm("a", "10.0.0.1", accelerators={"count": 0, "backend": "cuda", "model": "none"}),
        vm("b", "10.0.0.2", accelerators={"count": 0, "backend": "cuda", "model": "none"}),
    ]
    assert must_place(direct(accelerators={"count": 0}), records).path is PathClass.DIRECT
    must_not_place(direct(), records)  # the default asks for one


# -- exclusions ---------------------------------------------------------------------------------


def test_excluded_nodes_are_not_used() -> None:
    records = [vm("a", "10.0.0.1"), vm("b", "10.0.0.2"), vm("c", "10.0.0.3")]
    plan = must_place(direct(), records, exclusions=Exclusions(nodes={"a"}))
    assert plan.nodes == ["b", "c"]
    must_not_place(direct(), records, exclusions=Exclusions(nodes={"a", "b"}))


def test_excluded_addresses_are_not_advertised_on_relayed() -> None:
    records = [
        container("c1", "10.0.0.1"),
        container("c2", "10.0.0.2"),
        container("c3", "10.0.0.3"),
    ]
    plan = must_place(auto(), records, exclusions=Exclusions(addresses={"10.0.0.1"}))
    assert "10.0.0.1" not in [m.address for m in plan.members]
    must_not_place(auto(), records, exclusions=Exclusions(addresses={"10.0.0.1", "10.0.0.2"}))


def test_excluded_addresses_are_not_advertised_on_private() -> None:
    records = [
        private_vm("a", "10.0.0.1", "172.16.0.1"),
        private_vm("b", "10.0.0.2", "172.16.0.2"),
        private_vm("c", "10.0.0.3", "172.16.0.3"),
    ]
    plan = must_place(direct(), records, exclusions=Exclusions(addresses={"172.16.0.2"}))
    assert plan.path is PathClass.PRIVATE
    assert plan.nodes == ["a", "c"]


def test_excluding_a_nodes_only_machine_explains_the_shortfall() -> None:
    records = [vm("a", "10.0.0.1"), vm("b", "10.0.0.2")]
    shortfalls = must_not_place(direct(), records, exclusions=Exclusions(nodes={"a", "b"}))
    assert any(s.code is ErrorCode.UNSATISFIABLE for s in shortfalls)


# -- no false "unschedulable": the planner is not fooled by the order it meets machines --------


def test_relayed_gang_found_when_the_first_vm_shares_an_address_with_the_only_container() -> None:
    # vm1 and c1 share 10.0.0.1, so vm1+c1 is not a gang; vm1+vm2 is not qualified for Relayed
    # and neither VM can create the WireGuard device. vm2+c1 is a valid Relayed gang (G5, G6).
    records = [
        vm("vm1", "10.0.0.1", caps=BASE_CAPS),
        vm("vm2", "10.0.0.2", caps=BASE_CAPS),
        container("c1", "10.0.0.1"),
    ]
    plan = must_place(auto(), records)
    assert plan.path is PathClass.RELAYED
    assert sorted(plan.nodes) == ["c1", "vm2"]


def test_qualified_gang_found_even_when_the_first_machine_is_in_no_qualified_gang() -> None:
    cfg = config()
    cfg.qualified.direct = ["aws/vm+gcp/vm", "gcp/vm+azure/vm", "azure/vm+azure/vm"]
    records = [
        vm("a-aws", "10.0.0.1", provider="aws"),
        vm("b-gcp", "10.0.0.2", provider="gcp"),
        vm("c-azure", "10.0.0.3", provider="azure"),
        vm("d-azure", "10.0.0.4", provider="azure"),
    ]
    # gcp+azure+azure: every pair qualified.
    plan = must_place(direct(3), records, cfg=cfg)
    assert plan.nodes == ["b-gcp", "c-azure", "d-azure"]


# -- check_plan: the guard before a commit -----------------------------------------------------


def _records(*records: NodeRecord) -> dict[str, NodeRecord]:
    return {r.inventory.node: r for r in records}


def test_check_plan_accepts_a_planned_gang() -> None:
    records = [vm("a", "10.0.0.1"), vm("b", "10.0.0.2")]
    plan = must_place(direct(), records)
    assert check_plan(plan, _records(*records), direct()) == []


def test_check_plan_flags_a_machine_used_twice_and_the_member_count() -> None:
    a = container("a", "10.0.0.1")
    plan = Plan(
        PathClass.RELAYED,
        (PlannedMember(0, "a", "10.0.0.1", "eth0"), PlannedMember(1, "a", "10.0.0.1", "eth0")),
    )
    problems = check_plan(plan, _records(a), auto(3))
    assert any("G3" in p for p in problems)
    assert any("3" in p and "2" in p for p in problems)


def test_check_plan_flags_duplicate_and_unspecified_addresses() -> None:
    a, b = container("a", "0.0.0.0"), container("b", "0.0.0.0")
    plan = Plan(
        PathClass.RELAYED,
        (PlannedMember(0, "a", "0.0.0.0", "eth0"), PlannedMember(1, "b", "0.0.0.0", "eth0")),
    )
    problems = check_plan(plan, _records(a, b), auto())
    assert any("duplicate" in p for p in problems)
    assert any("unspecified" in p for p in problems)


def test_check_plan_flags_loopback_across_namespaces() -> None:
    a, b = container("a", "127.0.0.2", namespace="x"), container("b", "127.0.0.3", namespace="y")
    plan = Plan(
        PathClass.RELAYED,
        (PlannedMember(0, "a", "127.0.0.2", "eth0"), PlannedMember(1, "b", "127.0.0.3", "eth0")),
    )
    assert any("loopback" in p for p in check_plan(plan, _records(a, b), auto()))


def test_check_plan_flags_mixed_backends_scope_and_wrong_path() -> None:
    a = vm("a", "10.0.0.1", region="us-east-1")
    b = vm(
        "b",
        "10.0.0.2",
        region="us-west-2",
        accelerators={"count": 8, "backend": "rocm", "model": "MI300X"},
    )
    plan = Plan(
        PathClass.RELAYED,
        (PlannedMember(0, "a", "10.0.0.1", "eth0"), PlannedMember(1, "b", "10.0.0.2", "eth0")),
    )
    problems = check_plan(plan, _records(a, b), direct(2, "Colocated"))
    assert any("C5" in p for p in problems)
    assert any("G4" in p for p in problems)
    assert any("transport is Direct" in p for p in problems)
    assert any("VMs only" in p for p in problems)


def test_check_plan_flags_direct_addresses_outside_the_mesh_and_foreign_addresses() -> None:
    a, b = vm("a", "10.0.0.1"), vm("b", "10.0.0.2")
    outside = Plan(
        PathClass.DIRECT,
        (PlannedMember(0, "a", "10.0.0.1", "nodus0"), PlannedMember(1, "b", "10.0.0.2", "nodus0")),
    )
    assert any("100.64.0.0/10" in p for p in check_plan(outside, _records(a, b), direct()))
    c, d = container("c", "10.0.0.3"), container("d", "10.0.0.4")
    foreign = Plan(
        PathClass.RELAYED,
        (PlannedMember(0, "c", "10.9.9.9", "eth0"), PlannedMember(1, "d", "10.0.0.4", "eth0")),
    )
    assert any("own" in p for p in check_plan(foreign, _records(c, d), auto()))


def test_a_private_gang_may_mix_models_when_the_job_names_none() -> None:
    # Found by the no-false-unschedulable property: the private index must not split by model.
    records = [
        vm("h100", "10.0.0.1", privateNetwork="vpc-a", privateAddress="172.16.0.1", caps=VM_CAPS),
        vm(
            "a100",
            "10.0.0.2",
            privateNetwork="vpc-a",
            privateAddress="172.16.0.2",
            caps=VM_CAPS,
            accelerators={"count": 8, "backend": "cuda", "model": "A100"},
        ),
    ]
    plan, _ = Planner(config()).plan(
        job(distributed={"members": 2, "network": "Colocated"}), records
    )
    assert plan is not None and plan.path is PathClass.PRIVATE
    assert sorted(plan.nodes) == ["a100", "h100"]
    model_bound = job(accelerators={"model": "H100"}, distributed={"members": 2})
    plan, _ = Planner(config()).plan(model_bound, records)
    assert plan is None


def test_c3_a_plan_needing_more_tunnel_buffer_than_agents_allow_is_refused() -> None:
    small = [
        container("c1", "10.0.0.1", caps=BASE_CAPS),
        vm("v1", "10.0.0.2", caps=BASE_CAPS),
    ]
    for record in small:
        record.tunnel_buffer_limit_bytes = 1 << 20
    relayed = job(distributed={"members": 2, "transport": "Auto"})
    plan, shortfalls = Planner(config()).plan(relayed, small)
    assert plan is None
    refusal = next(s for s in shortfalls if s.path is PathClass.RELAYED)
    assert refusal.code is ErrorCode.BOUNDS_EXCEEDED
    assert "14 MiB" in refusal.message and "at most 1 MiB" in refusal.message
    for record in small:
        record.tunnel_buffer_limit_bytes = 64 << 20
    plan, _ = Planner(config()).plan(relayed, small)
    assert plan is not None and plan.path is PathClass.RELAYED

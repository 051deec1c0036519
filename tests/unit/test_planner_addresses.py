"""The placer's planner, sans-I/O: the addresses it advertises (G7, C4) and the mesh
addresses of a Direct gang."""

from __future__ import annotations

import ipaddress

import pytest

from libs.contracts.jobs import PathClass
from services.placer.addresses import MESH_NETWORK, address_problem, mesh_addresses
from tests.planner_support import (
    auto,
    container,
    direct,
    must_not_place,
    must_place,
    private_vm,
    vm,
)

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

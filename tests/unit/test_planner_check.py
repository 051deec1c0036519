"""The placer's planner, sans-I/O: `check_plan`, the guard before a commit."""

from __future__ import annotations

from libs.contracts.fleet import NodeRecord
from libs.contracts.jobs import PathClass
from services.placer.invariants import check_plan
from services.placer.planner import Plan, PlannedMember
from tests.planner_support import auto, container, direct, must_place, vm

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

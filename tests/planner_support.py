"""Builders for the planner's unit tests (tests/unit/test_planner_*.py): machines as the
fleet registers them, jobs by transport, and `place`, which checks every plan it gets against
`check_plan` (the guard before a commit)."""

from __future__ import annotations

from typing import Any

from libs.contracts.errors import ErrorCode
from libs.contracts.fleet import NodeRecord
from libs.contracts.jobs import Job, PathClass
from libs.contracts.placer import PlacerConfig
from services.placer.config import load_config
from services.placer.invariants import check_plan
from services.placer.planner import Exclusions, Plan, Planner, Shortfall
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
    measured: dict[PathClass, set[str]] | dict[PathClass, dict[str, int]] | None = None,
) -> tuple[Plan | None, list[Shortfall]]:
    """`measured`: per path the pairs `nodus qualify` measured (in a gang of 2 when a set)."""
    planner = Planner(cfg or config())
    planner.measured = {
        path: pairs if isinstance(pairs, dict) else dict.fromkeys(pairs, 2)
        for path, pairs in (measured or {}).items()
    }
    plan, shortfalls = planner.plan(the_job, records, exclusions, mesh_id)
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

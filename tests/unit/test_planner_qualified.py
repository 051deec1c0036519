"""G21 in the planner: measured pairs (`nodus qualify`) qualify a path beside the config's
override, and a qualification run is placed on its own pair and path only."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from app.cli.qualify import qualification_job
from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.jobs import QUALIFY_ORG, Job, PathClass
from libs.contracts.placer import PlacerConfig
from libs.contracts.qualify import Qualification, qualification_key, qualified_pairs
from services.placer.admission import check_static
from services.placer.planner import Planner
from tests.factories import job
from tests.planner_support import (
    auto,
    codes,
    config,
    container,
    direct,
    must_not_place,
    must_place,
    vm,
)

PAIR = [vm("l1", "10.0.0.1", provider="lambda"), vm("c1", "10.0.0.2", provider="crusoe")]


def unqualified() -> PlacerConfig:
    cfg = config()
    cfg.qualified.direct = []
    cfg.qualified.relayed = []
    return cfg


def test_a_measured_pair_qualifies_its_path_and_nothing_else() -> None:
    cfg = unqualified()
    shortfalls = must_not_place(direct(), PAIR, cfg=cfg)
    assert codes(shortfalls)[PathClass.DIRECT] is ErrorCode.NOT_QUALIFIED
    refusal = next(s for s in shortfalls if s.path is PathClass.DIRECT)
    assert "nodus qualify --path direct" in refusal.message
    measured = {PathClass.DIRECT: {"crusoe/vm+lambda/vm"}}
    assert must_place(direct(), PAIR, cfg=cfg, measured=measured).path is PathClass.DIRECT
    other = [vm("l1", "10.0.0.1", provider="lambda"), vm("a1", "10.0.0.2", provider="aws")]
    must_not_place(direct(), other, cfg=cfg, measured=measured)


def qualification(path: str, offerings: str, transport: str) -> Job:
    return job(
        "qualify-x",
        org=QUALIFY_ORG,
        distributed={"members": 2, "transport": transport},
        qualify={"path": path, "offerings": offerings},
    )


def test_a_qualification_run_is_placed_on_its_pair_and_path_though_nothing_is_qualified() -> None:
    cfg = unqualified()
    run = qualification("direct", "lambda/vm+crusoe/vm", "Direct")
    assert must_place(run, PAIR, cfg=cfg).path is PathClass.DIRECT
    relayed = qualification("relayed", "vm+vm", "Auto")  # Relayed measured between VMs
    assert must_place(relayed, PAIR, cfg=cfg).path is PathClass.RELAYED
    elsewhere = qualification("direct", "aws/vm+aws/vm", "Direct")
    must_not_place(elsewhere, PAIR, cfg=cfg)
    mixed = [vm("l1", "10.0.0.1", provider="lambda"), container("v1", "10.0.0.3")]
    run = qualification("relayed", "vm+container", "Auto")
    assert must_place(run, mixed, cfg=cfg).path is PathClass.RELAYED


def test_qualification_runs_belong_to_the_operators_org_and_measure_one_pair() -> None:
    planner = Planner(config())
    other_org = job("q", org="acme", qualify={"path": "direct", "offerings": "vm+vm"})
    with pytest.raises(NodusError, match="nodus-system"):
        check_static(other_org, planner)
    three = job(
        "q",
        org=QUALIFY_ORG,
        distributed={"members": 3},
        qualify={"path": "direct", "offerings": "vm+vm"},
    )
    with pytest.raises(NodusError, match="members must be 2"):
        check_static(three, planner)


# -- Relayed gangs of more than two (issue 26) -------------------------------------------------

CONTAINERS = [container(f"v{i}", f"10.0.1.{i}", provider="vast") for i in range(1, 5)]
FOUR_RELAYED = auto(4)


def test_a_relayed_gang_larger_than_the_limit_is_refused_until_its_size_is_qualified() -> None:
    shortfalls = must_not_place(FOUR_RELAYED, CONTAINERS)
    refusal = next(s for s in shortfalls if s.path is PathClass.RELAYED)
    assert refusal.code is ErrorCode.RELAYED_MEMBERS
    assert "nodus qualify --path relayed --members 4" in refusal.message
    # Measured in pairs only, or in a gang of 3: not enough for 4.
    for size in (2, 3):
        measured = {PathClass.RELAYED: {"vast/container+vast/container": size}}
        must_not_place(FOUR_RELAYED, CONTAINERS, measured=measured)
    for size in (4, 8):
        measured = {PathClass.RELAYED: {"vast/container+vast/container": size}}
        plan = must_place(FOUR_RELAYED, CONTAINERS, measured=measured)
        assert plan.path is PathClass.RELAYED and len(plan.members) == 4
    # Qualified on other offerings: refused, and the refusal names what is qualified.
    elsewhere = {PathClass.RELAYED: {"lambda/container+lambda/container": 4}}
    shortfalls = must_not_place(FOUR_RELAYED, CONTAINERS, measured=elsewhere)
    message = next(s.message for s in shortfalls if s.path is PathClass.RELAYED)
    assert "lambda/container+lambda/container" in message


def test_the_operators_limit_admits_a_larger_relayed_gang_outright() -> None:
    plan = must_place(FOUR_RELAYED, CONTAINERS, cfg=config(relayed_max_members=4))
    assert plan.path is PathClass.RELAYED


def test_a_qualification_of_a_gang_on_two_types_qualifies_the_pairs_it_put_side_by_side() -> None:
    t = datetime(2026, 12, 4, tzinfo=UTC)

    def record(pair: str, members: int, ok: bool = True) -> Qualification:
        return Qualification(
            path=PathClass.RELAYED,
            pair=pair,
            machines=[],
            ok=ok,
            tcp_gbps=1.0,
            rtt_ms=1.0,
            allreduce_bus_gbps=None,
            job="j",
            measured_time=t,
            members=members,
        )

    qualified = qualified_pairs(
        [
            record("a/vm+b/container", 4),
            record("a/vm+b/container", 8, ok=False),
            record("c/vm+c/vm", 2),
        ]
    )
    assert qualified[PathClass.RELAYED] == {
        "a/vm+b/container": 4,
        "a/vm+a/vm": 4,
        "b/container+b/container": 4,
        "c/vm+c/vm": 2,
    }
    assert qualification_key(PathClass.RELAYED, "a/vm+b/container", 4).endswith(".m4")


def test_a_relayed_qualification_run_may_measure_a_gang_of_up_to_eight() -> None:
    planner = Planner(config())
    run = job(
        "q",
        org=QUALIFY_ORG,
        distributed={"members": 4, "transport": "Auto"},
        qualify={"path": "relayed", "offerings": "container+container"},
    )
    check_static(run, planner)
    plan = must_place(run, CONTAINERS, cfg=unqualified())
    assert plan.path is PathClass.RELAYED and len(plan.members) == 4
    with pytest.raises(NodusError, match="only a Relayed run"):
        qualification_job(PathClass.DIRECT, "vm+vm", 64, members=4)

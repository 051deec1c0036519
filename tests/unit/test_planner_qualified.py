"""G21 in the planner: measured pairs (`nodus qualify`) qualify a path beside the config's
override, and a qualification run is placed on its own pair and path only."""

from __future__ import annotations

import pytest

from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.jobs import QUALIFY_ORG, Job, PathClass
from libs.contracts.placer import PlacerConfig
from services.placer.admission import check_static
from services.placer.planner import Planner
from tests.factories import job
from tests.planner_support import codes, config, container, direct, must_not_place, must_place, vm

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

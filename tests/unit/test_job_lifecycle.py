"""A job's life (libs/jobs/lifecycle.py): each transition lands in the phase its table says, with
the fields a user reads in `nodus describe` (conditions, avoid, bill) and the event that
records it; `status.phase` is assigned in that module only; the docs show its diagram."""

from __future__ import annotations

import ast
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from libs.contracts.jobs import (
    ConditionType,
    GangMember,
    GangStatus,
    JobStatus,
    PathClass,
    Phase,
    Probe,
)
from libs.jobs import lifecycle
from libs.jobs.lifecycle import Step, Transition

ROOT = Path(__file__).resolve().parents[2]
T0 = datetime(2026, 1, 1, tzinfo=UTC)
GANG = GangStatus(
    transport=PathClass.RELAYED,
    members=[GangMember(rank=0, node="a", address="10.0.0.1")],
)


def condition(status: JobStatus, kind: ConditionType) -> tuple[str, str]:
    found = next(c for c in status.conditions if c.type == kind)
    return found.status, found.reason


def _in(phase: Phase, epoch: int = 1, **fields: object) -> JobStatus:
    """A status in `phase`, reached through the lifecycle itself."""
    status = lifecycle.admitted(T0, "placer-0").status
    if phase is Phase.PENDING:
        return status
    status = lifecycle.placed(status, epoch, GANG, "placer-0", T0).status
    if phase is not Phase.PLACED:
        status = lifecycle.probing(status).status
    if phase is Phase.RUNNING:
        status = lifecycle.running(status, T0 + timedelta(seconds=30)).status
    return status


def check(step: Step, transition: Transition, before: JobStatus) -> JobStatus:
    assert before.phase in transition.sources or not transition.sources
    assert step.status.phase is (transition.target or before.phase)
    return step.status


def test_admitted_then_placed_then_probing_then_running_then_succeeded_with_its_bill() -> None:
    admitted = lifecycle.admitted(T0, "placer-0")
    assert admitted.status.phase is Phase.PENDING and admitted.event == "admitted"
    assert condition(admitted.status, ConditionType.ADMITTED) == ("True", "Admitted")

    placed = lifecycle.placed(admitted.status, 1, GANG, "placer-1", T0 + timedelta(seconds=1))
    status = check(placed, lifecycle.PLACED, admitted.status)
    assert (status.epoch, status.placed_by, status.gang) == (1, "placer-1", GANG)
    assert placed.event == "placed" and "a (relayed)" in placed.message

    probing = lifecycle.probing(status)
    status = check(probing, lifecycle.PROBING, status)
    assert lifecycle.probing(status).event is None  # already probing: nothing new to say

    probe = Probe(tcp_gbps=0.9, rtt_ms=2.0, path="derp:us", measured_time=T0)
    status = check(lifecycle.qualified(status, probe, "1 pair", T0), lifecycle.QUALIFIED, status)
    assert status.gang is not None and status.gang.probe == probe

    started = T0 + timedelta(seconds=31)
    status = check(lifecycle.running(status, started), lifecycle.RUNNING, status)
    assert status.runs == 1 and status.billing is not None
    assert status.billing.boot_seconds == 30.0  # placed at T0 + 1 s, started at T0 + 31 s

    ended = started + timedelta(seconds=60)
    done = lifecycle.finished(status, True, "Completed", "every rank exited 0", ended, 3 << 30)
    status = check(done, lifecycle.SUCCEEDED, status)
    assert done.event == "succeeded" and status.finished_time == ended
    assert status.billing is not None
    assert (status.billing.boot_seconds, status.billing.run_seconds) == (30.0, 60.0)
    assert status.billing.mesh_relay_gi_b == 3.0


def test_a_failed_run_is_failed_and_billed() -> None:
    status = _in(Phase.RUNNING)
    step = lifecycle.finished(status, False, "RankFailed", "rank 1 exited 3", T0, 0)
    assert check(step, lifecycle.FAILED, status).phase is Phase.FAILED
    assert step.event == "failed" and "rank 1 exited 3" in step.message


@pytest.mark.parametrize("phase", [Phase.PLACED, Phase.PROBING, Phase.RUNNING])
def test_members_lost_go_back_to_pending_avoiding_and_remembering_them(phase: Phase) -> None:
    status = _in(phase)
    step = lifecycle.members_lost(status, ["a"], lifecycle.MEMBER_LOST, "a went silent", T0)
    status = check(step, lifecycle.MEMBERS_LOST, status)
    assert (status.avoid, status.lost) == (["a"], ["a"])
    assert condition(status, ConditionType.GANG_READY) == ("False", "MemberLost")
    assert step.event == "MemberLost"


def test_a_failed_probe_avoids_its_suspect_for_good() -> None:
    status = lifecycle.members_lost(_in(Phase.PROBING), ["b"], "MemberLost", "", T0).status
    status = lifecycle.placed(status, 2, GANG, "placer-0", T0).status
    status = lifecycle.probing(status).status
    step = lifecycle.probe_failed(status, "b", "pair a-b: no route", T0)
    status = check(step, lifecycle.PROBE_FAILED, status)
    assert status.avoid == ["b", "b"] and status.lost == []  # avoided for good (G12)
    assert condition(status, ConditionType.NETWORK_QUALIFIED) == ("False", "ProbeFailed")


def test_a_direct_path_that_failed_continues_as_relayed() -> None:
    status = _in(Phase.PROBING)
    step = lifecycle.relayed_instead(status, "pair a-b: no UDP", T0)
    status = check(step, lifecycle.RELAYED_INSTEAD, status)
    assert status.path_override is PathClass.RELAYED and status.avoid == []


def test_exhausted_epochs_and_a_shim_that_does_not_load_fail_the_job() -> None:
    status = _in(Phase.PROBING, epoch=3)
    step = lifecycle.exhausted(status, 3, ["epoch 1: x", "epoch 2: y"], T0)
    assert check(step, lifecycle.EXHAUSTED, status).finished_time == T0
    assert "epoch 1: x; epoch 2: y" in step.message
    shim = lifecycle.shim_not_loaded(status, "static binary", T0 + timedelta(seconds=5))
    failed = check(shim, lifecycle.SHIM_NOT_LOADED, status)
    assert failed.billing is not None and failed.billing.boot_seconds == 5.0


def test_conditions_only_change_when_there_is_something_new_to_say() -> None:
    pending = _in(Phase.PENDING)
    said = lifecycle.not_ready(pending, "False", "NoCapacity", "no machine fits", T0)
    assert said.event == "NoCapacity" and said.status.phase is Phase.PENDING
    again = lifecycle.not_ready(said.status, "False", "NoCapacity", "no machine fits", T0)
    assert again.event is None
    running = _in(Phase.RUNNING)
    assert lifecycle.degraded(running, "False", "AllDirect", "every pair", T0).event is None
    step = lifecycle.degraded(running, "True", "RelayFallback", "a-b (derp:us)", T0)
    assert step.event == "RelayFallback" and step.status.phase is Phase.RUNNING


def test_the_phase_is_assigned_in_the_lifecycle_module_only() -> None:
    writers = []
    for top in ("app", "libs", "services"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if path == ROOT / "libs" / "jobs" / "lifecycle.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.keyword) and node.arg == "phase":
                    value = ast.unparse(node.value)
                    if value.startswith(("Phase.", "status.phase", "job.status.phase")):
                        if not value.endswith(".value"):  # a ranktable's copy, as text
                            writers.append(f"{path.relative_to(ROOT)}:{node.value.lineno}")
                if isinstance(node, ast.Attribute) and node.attr == "phase":
                    if isinstance(getattr(node, "ctx", None), ast.Store):
                        writers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert writers == []


def test_the_docs_show_the_lifecycle_as_it_is() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    shown = re.search(r"```mermaid\n(stateDiagram-v2\n.*?)```", text, re.S)
    assert shown is not None, "docs/architecture.md has no job state diagram"
    assert shown.group(1) == lifecycle.mermaid()


def test_a_step_records_its_event_with_the_status_and_leaves_the_given_status_alone() -> None:
    given = lifecycle.admitted(datetime(2026, 12, 4, tzinfo=UTC), "placer-0").status
    first = given.last_event
    assert first is not None and (first.kind, first.seq) == ("admitted", 1)
    step = lifecycle.deleted(given)
    assert step.status.last_event is not None
    assert (step.status.last_event.kind, step.status.last_event.seq) == ("deleted", 2)
    assert given.last_event is first  # the caller's record is not changed under it

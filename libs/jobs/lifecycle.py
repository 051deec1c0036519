"""A job's life, pure: every transition of its status as a function from the status and what was
observed to the next status and the event that says so. The placer, the runner and the
remediator decide *when* and write the result by compare-and-set (`libs.jobs.store`); none of
them composes a status by hand, and `status.phase` is assigned here only.

    Pending -> Placed -> Probing -> Running -> Succeeded | Failed
       ^         |          |          |
       +---------+----------+----------+  back to Pending: members lost, a probe failed, a
                                          Direct path failed (continues as Relayed)

`TRANSITIONS` is the same diagram as data; docs/architecture.md shows it (`mermaid()`, checked
by tests/unit/test_job_lifecycle.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Literal

import msgspec

from libs.contracts.base import now
from libs.contracts.jobs import (
    EARLIER_EVENTS_KEPT,
    FINISHED_PHASES,
    Billing,
    ConditionType,
    GangStatus,
    JobStatus,
    LastEvent,
    PathClass,
    Phase,
    Probe,
    with_condition,
)

# The phase groups. An epoch holds machines while its job is ACTIVE; its probe is owed while
# the job AWAITS_PROBE; a FINISHED job is billed and holds nothing.
ACTIVE = frozenset({Phase.PLACED, Phase.PROBING, Phase.RUNNING})
AWAITS_PROBE = frozenset({Phase.PLACED, Phase.PROBING})
FINISHED = FINISHED_PHASES

NODE_REPAIR = "NodeRepair"  # R16: a repair interrupts the gang
FAULT_BROKE_MEMBER = "FaultBrokeMember"  # R17: a fault took away what a member runs on
MEMBER_LOST = "MemberLost"  # a member stopped heartbeating, turned unhealthy or booted again

State = Literal["True", "False", "Unknown"]


@dataclass(frozen=True, slots=True)
class Step:
    """A transition's result: the next status, and the event (`nodus.evt.job.<gang>.<kind>`)
    that records it; no event when nothing a reader would notice changed."""

    status: JobStatus
    event: str | None = None
    message: str = ""

    def __post_init__(self) -> None:
        if self.event is not None:  # written with the status it records (LastEvent)
            last = self.status.last_event
            seq = last.seq + 1 if last is not None else 1
            # A copy: a transition may hand back the status it was given (deleted), which
            # its caller still holds.
            recorded = LastEvent(self.event, self.message, now(), seq, self.status.epoch)
            earlier = self.status.earlier_events + ([last] if last is not None else [])
            status = msgspec.structs.replace(
                self.status,
                last_event=recorded,
                earlier_events=earlier[-EARLIER_EVENTS_KEPT:],
            )
            object.__setattr__(self, "status", status)


@dataclass(frozen=True, slots=True)
class Transition:
    name: str
    sources: frozenset[Phase]
    target: Phase | None  # None: the phase stays (a condition or a measurement changes)


def _t(name: str, sources: set[Phase] | frozenset[Phase], target: Phase | None) -> Transition:
    return Transition(name, frozenset(sources), target)


# Every transition, from where to where: what the compare-and-set of each allows.
ADMITTED = _t("admitted", set(), Phase.PENDING)
PLACED = _t("placed", {Phase.PENDING}, Phase.PLACED)
NOT_READY = _t("not ready", {Phase.PENDING}, None)
PROBING = _t("probing", AWAITS_PROBE, Phase.PROBING)
QUALIFIED = _t("qualified", {Phase.PROBING}, None)
RUNNING = _t("running", {Phase.PROBING}, Phase.RUNNING)
DEGRADED = _t("degraded", {Phase.RUNNING}, None)
SUCCEEDED = _t("succeeded", {Phase.RUNNING}, Phase.SUCCEEDED)
FAILED = _t("failed", {Phase.RUNNING}, Phase.FAILED)
MEMBERS_LOST = _t("members lost", ACTIVE, Phase.PENDING)
PROBE_FAILED = _t("probe failed", {Phase.PROBING}, Phase.PENDING)
RELAYED_INSTEAD = _t("direct path failed", {Phase.PROBING}, Phase.PENDING)
EXHAUSTED = _t("epochs exhausted", {Phase.PROBING}, Phase.FAILED)
SHIM_NOT_LOADED = _t("shim not loaded", {Phase.PROBING}, Phase.FAILED)
TRANSITIONS = (
    ADMITTED,
    PLACED,
    NOT_READY,
    PROBING,
    QUALIFIED,
    RUNNING,
    DEGRADED,
    SUCCEEDED,
    FAILED,
    MEMBERS_LOST,
    PROBE_FAILED,
    RELAYED_INSTEAD,
    EXHAUSTED,
    SHIM_NOT_LOADED,
)


def _to(status: JobStatus, transition: Transition, **changes: object) -> JobStatus:
    assert transition.target is not None
    return msgspec.structs.replace(status, phase=transition.target, **changes)


# -- admission and placement (the placer) ----------------------------------------------------


def admitted(t: datetime, replica: str) -> Step:
    status = JobStatus(created_time=t, placed_by=replica)
    message = "admitted; waiting for placement"
    status = with_condition(status, ConditionType.ADMITTED, "True", "Admitted", message, t)
    return Step(status, "admitted", "admitted")


def placed(status: JobStatus, epoch: int, gang: GangStatus, replica: str, t: datetime) -> Step:
    nodes = ", ".join(m.node for m in gang.members)
    status = _to(status, PLACED, epoch=epoch, gang=gang, placed_time=t, placed_by=replica)
    path = gang.transport.value
    message = f"epoch {epoch} placed on the {path} path"
    status = with_condition(status, ConditionType.GANG_READY, "True", "Placed", message, t)
    return Step(status, "placed", f"placed on {nodes} ({path})")


def deleted(status: JobStatus) -> Step:
    """A job deleted by request: its record goes (the placer fences its epoch first); the
    event stays as its audit."""
    return Step(status, "deleted", "deleted by request")


def not_ready(status: JobStatus, state: State, reason: str, message: str, t: datetime) -> Step:
    """Why a Pending gang is not placed yet (no capacity, an address collision, ...); no step
    when it already says so."""
    existing = next((c for c in status.conditions if c.type == ConditionType.GANG_READY), None)
    if existing is not None and (existing.status, existing.reason, existing.message) == (
        state,
        reason,
        message,
    ):
        return Step(status)
    return Step(
        with_condition(status, ConditionType.GANG_READY, state, reason, message, t),
        reason,
        message,
    )


# -- the probe and the run (the runner) ------------------------------------------------------


def probing(status: JobStatus) -> Step:
    if status.phase is Phase.PROBING:
        return Step(status)
    return Step(_to(status, PROBING), "probing", f"probing epoch {status.epoch}")


def qualified(status: JobStatus, probe: Probe, message: str, t: datetime) -> Step:
    gang = msgspec.structs.replace(status.gang, probe=probe) if status.gang else None
    status = msgspec.structs.replace(status, gang=gang)
    status = with_condition(
        status, ConditionType.NETWORK_QUALIFIED, "True", "ProbePassed", message, t
    )
    return Step(status, "qualified", message)


def boot_billed(status: JobStatus, t: datetime) -> Billing:
    """Placement through the probe is billed as boot time (G10), up to `t`."""
    return Billing(boot_seconds=round((t - (status.placed_time or t)).total_seconds(), 3))


def running(status: JobStatus, t: datetime) -> Step:
    status = _to(
        status, RUNNING, run_started_time=t, billing=boot_billed(status, t), runs=status.runs + 1
    )
    return Step(status, "running", f"epoch {status.epoch}'s ranks started")


def degraded(status: JobStatus, state: State, reason: str, message: str, t: datetime) -> Step:
    """G13: NetworkDegraded while some pair goes through the relays; nothing said of a gang
    that never was."""
    current = next((c for c in status.conditions if c.type == ConditionType.NETWORK_DEGRADED), None)
    if current is None and state == "False":
        return Step(status)
    if current is not None and (current.status, current.message) == (state, message):
        return Step(status)
    status = with_condition(status, ConditionType.NETWORK_DEGRADED, state, reason, message, t)
    return Step(status, reason, message)


def finished(
    status: JobStatus, succeeded: bool, reason: str, message: str, t: datetime, relay_bytes: int
) -> Step:
    """The run's end at `t`, billed: boot time as billed at the start, run time, relay bytes."""
    # A rank can end before the launch replies are all in and the run's start is set.
    end = max(t, status.run_started_time or t)
    run = (end - (status.run_started_time or end)).total_seconds()
    boot = status.billing.boot_seconds if status.billing else 0.0
    billing = Billing(
        boot_seconds=boot, run_seconds=round(run, 3), mesh_relay_gi_b=relay_bytes / 2**30
    )
    status = _to(status, SUCCEEDED if succeeded else FAILED, finished_time=end, billing=billing)
    status = with_condition(status, ConditionType.GANG_READY, "False", reason, message, end)
    return Step(status, "succeeded" if succeeded else "failed", f"{reason}: {message}")


# -- back to placement, or the end -----------------------------------------------------------


def members_lost(
    status: JobStatus, nodes: list[str], reason: str, message: str, t: datetime
) -> Step:
    """Back to placement without `nodes`, which it lost (R16, R17): avoided while another
    machine fits, used again when none does once they are healthy and free (`status.lost`)."""
    status = with_condition(status, ConditionType.GANG_READY, "False", reason, message, t)
    status = _to(status, MEMBERS_LOST, avoid=[*status.avoid, *nodes], lost=[*status.lost, *nodes])
    return Step(status, reason, message)


def probe_failed(status: JobStatus, suspect: str, reason: str, t: datetime) -> Step:
    """G12: placed again without the failing pair's suspect, avoided for good."""
    status = with_condition(
        status, ConditionType.NETWORK_QUALIFIED, "False", "ProbeFailed", reason, t
    )
    status = _to(
        status,
        PROBE_FAILED,
        avoid=[*status.avoid, suspect],
        lost=[n for n in status.lost if n != suspect],
    )
    return Step(status, "ProbeFailed", f"{reason}; placing it again without {suspect}")


def relayed_instead(status: JobStatus, reason: str, t: datetime) -> Step:
    """G12: an Auto gang whose direct path failed continues as Relayed, on the same machines."""
    message = f"{reason}; continuing as Relayed"
    status = with_condition(
        status, ConditionType.NETWORK_QUALIFIED, "False", "DirectPathFailed", message, t
    )
    return Step(
        _to(status, RELAYED_INSTEAD, path_override=PathClass.RELAYED), "DirectPathFailed", message
    )


def exhausted(status: JobStatus, epochs: int, history: list[str], t: datetime) -> Step:
    """A gang that cannot be qualified after a bounded number of epochs fails, with every
    epoch's reason (the failed epochs were not billed)."""
    message = f"no qualified placement after {epochs} epochs: " + "; ".join(history)
    status = with_condition(
        status, ConditionType.GANG_READY, "False", "EpochsExhausted", message, t
    )
    return Step(_to(status, EXHAUSTED, finished_time=t), "EpochsExhausted", message)


def shim_not_loaded(status: JobStatus, why: str, t: datetime) -> Step:
    """G10.3: the shim does not load in the job's image: the job fails, its boot billed."""
    status = with_condition(
        status, ConditionType.NETWORK_QUALIFIED, "False", "ShimNotLoaded", why, t
    )
    status = _to(status, SHIM_NOT_LOADED, finished_time=t, billing=boot_billed(status, t))
    return Step(status, "ShimNotLoaded", why)


# -- the diagram -------------------------------------------------------------------------------


def mermaid() -> str:
    """The state diagram of a job, as docs/architecture.md shows it."""
    lines = ["stateDiagram-v2", f"    [*] --> {Phase.PENDING.value}: {ADMITTED.name}"]
    for transition in TRANSITIONS:
        if transition.target is None or not transition.sources:
            continue
        for source in sorted(transition.sources - {transition.target}, key=list(Phase).index):
            lines.append(f"    {source.value} --> {transition.target.value}: {transition.name}")
    lines += [f"    {phase.value} --> [*]" for phase in sorted(FINISHED, key=list(Phase).index)]
    return "\n".join(lines) + "\n"

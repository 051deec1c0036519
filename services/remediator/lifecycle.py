"""The remediation's state machine, without I/O (R6, R7, R12, R14):

    Pending -> Approved -> WaitingIdle -> Running -> Revalidating -> Done | Failed
        \\---------\\------------\\-> Cancelled (by a person, or its alert cleared: SelfResolved)

Each function takes the record and what was observed, and returns the next record (or a
decision); the shell writes it with compare-and-set, so a step is taken once."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Literal

import msgspec

from libs.contracts.remediation import (
    Action,
    Approver,
    Outcome,
    Policy,
    Remediation,
    RemediationState,
    Transition,
)

MAX_HISTORY = 50


def remediation_id(node: str, *parts: object) -> str:
    """Derived from what the repair is about, so replicas agree on it: `<node>.<digest>`."""
    digest = hashlib.sha256("\x00".join(str(p) for p in parts).encode()).hexdigest()[:10]
    return f"{node}.{digest}"


def move(
    rem: Remediation,
    state: RemediationState,
    now: datetime,
    by: str,
    reason: str,
    **changes: object,
) -> Remediation:
    """A transition, recorded in the history (R7)."""
    history = [*rem.history, Transition(state=state, time=now, by=by, reason=reason)]
    return msgspec.structs.replace(
        rem, state=state, reason=reason, history=history[-MAX_HISTORY:], **changes
    )


def approve(rem: Remediation, approver: Approver, now: datetime) -> Remediation:
    return move(
        rem,
        RemediationState.APPROVED,
        now,
        approver.name,
        f"approved by {approver.kind} {approver.name}: {approver.rule}".rstrip(": "),
        approver=approver,
        approved_time=now,
    )


def finish(
    rem: Remediation, outcome: Outcome, now: datetime, by: str, reason: str, **changes: object
) -> Remediation:
    state = {
        Outcome.DONE: RemediationState.DONE,
        Outcome.FAILED: RemediationState.FAILED,
        Outcome.CANCELLED: RemediationState.CANCELLED,
        Outcome.SELF_RESOLVED: RemediationState.CANCELLED,
    }[outcome]
    return move(rem, state, now, by, reason, outcome=outcome, finished_time=now, **changes)


def start_waiting(rem: Remediation, policy: Policy, now: datetime, by: str) -> Remediation:
    """Approved -> WaitingIdle: the node is cordoned; the idle wait starts (R6)."""
    never = policy.idle.never_interrupt
    deadline = None if never else now + timedelta(seconds=policy.idle.max_wait_seconds)
    wait = (
        "without limit (never interrupt running jobs)" if never else f"until {deadline:%H:%M:%S}Z"
    )
    return move(
        rem,
        RemediationState.WAITING_IDLE,
        now,
        by,
        f"cordoned; waiting for the node to be idle {wait}",
        wait_start_time=now,
        idle_deadline_time=deadline,
        never_interrupt=never,
    )


@dataclass(frozen=True, slots=True)
class IdleDecision:
    go: bool
    interrupt: list[str]  # gangs still running that the repair interrupts
    reason: str


def idle_decision(rem: Remediation, running: list[str], now: datetime) -> IdleDecision:
    """R6: go when no job runs on the node; when jobs run, wait until the max wait ran out,
    or forever with never-interrupt."""
    if not running:
        return IdleDecision(True, [], "node is idle")
    gangs = ", ".join(sorted(running))
    if rem.breaks_workload:  # R17: its ranks cannot run; never-interrupt is for the others
        return IdleDecision(
            True, sorted(running), f"the fault broke {gangs}'s member: its epoch ends (R17)"
        )
    if rem.never_interrupt or rem.idle_deadline_time is None:
        return IdleDecision(False, [], f"waiting for idle: {gangs} running; never interrupts")
    if now < rem.idle_deadline_time:
        return IdleDecision(
            False,
            [],
            f"waiting for idle: {gangs} running; max wait ends "
            f"{rem.idle_deadline_time:%Y-%m-%dT%H:%M:%S}Z",
        )
    return IdleDecision(True, sorted(running), f"max wait ran out; interrupting {gangs}")


def issue_decision(
    rem: Remediation, boot_id: str, executed: bool
) -> tuple[Literal["issue", "skip"], str]:
    """Before the action is issued (or issued again after a restart): R12, a host whose boot id
    changed since the repair started already came back and is not rebooted or cycled again;
    an action the provider already carried out for this op is not repeated (R14)."""
    if executed:
        return "skip", f"the provider already carried out {rem.op_id}"
    if (
        rem.action in (Action.REBOOT, Action.POWER_CYCLE)
        and rem.boot_id_before
        and boot_id
        and boot_id != rem.boot_id_before
    ):
        return "skip", (
            f"boot id changed from {rem.boot_id_before} to {boot_id}: the host already came "
            "back, so it is not cycled again (R12)"
        )
    return "issue", ""


def came_back(rem: Remediation, boot_id: str, host_id: str, retired: bool) -> bool:
    """Did the machine come back from the action? A new boot id (its agent registered again
    after booting); after a migrate also on a new host; a deleted machine once retired."""
    if rem.action is Action.DELETE:
        return retired
    if rem.issued_time is None:
        return False
    fresh_boot = bool(boot_id) and boot_id != rem.boot_id_before
    if rem.action is Action.MIGRATE:
        return fresh_boot and bool(host_id) and host_id != rem.host_before
    return fresh_boot


def timed_out(rem: Remediation, now: datetime, timeout: timedelta) -> bool:
    start = rem.issued_time or rem.started_time
    return start is not None and now - start > timeout

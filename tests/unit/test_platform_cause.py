"""R17: which failed ranks the platform, not the workload, ended."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import msgspec

from libs.contracts.remediation import (
    Action,
    Alert,
    AlertKind,
    AlertState,
    Remediation,
    RemediationState,
    Requester,
)
from services.runner.platform import platform_cause

T = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)


def _alert(breaks: bool, seen: datetime, state: AlertState = AlertState.FIRING) -> Alert:
    return Alert(
        id="gpu-a.xid-79.0",
        node="gpu-a",
        kind=AlertKind.XID,
        subject="0",
        severity="critical",
        summary="Xid 79 (GPU has fallen off the bus) on GPU 0 on gpu-a",
        description="",
        source="kmsg",
        action=Action.POWER_CYCLE,
        state=state,
        first_seen_time=seen,
        last_seen_time=seen,
        window_start_time=seen,
        xid=79,
        breaks_workload=breaks,
        resolved_time=seen + timedelta(seconds=5) if state is AlertState.RESOLVED else None,
    )


def test_a_fault_that_breaks_a_member_explains_a_rank_that_died_around_it() -> None:
    # The rank died first; the Xid line was read 3 s later.
    cause = platform_cause("gpu-a", T, [_alert(True, T + timedelta(seconds=3))], [])
    assert cause is not None and "Xid 79" in cause and "R17" in cause
    # ... or the fault fired while the rank still ran.
    assert platform_cause("gpu-a", T, [_alert(True, T - timedelta(minutes=10))], []) is not None


def test_workload_faults_other_machines_and_old_faults_explain_nothing() -> None:
    assert platform_cause("gpu-a", T, [_alert(False, T)], []) is None  # Xid 13, thermal
    assert platform_cause("gpu-b", T, [_alert(True, T)], []) is None
    later = T + timedelta(minutes=5)
    assert platform_cause("gpu-a", T, [_alert(True, later)], []) is None
    over = _alert(True, T - timedelta(hours=1), AlertState.RESOLVED)
    assert platform_cause("gpu-a", T, [over], []) is None


def test_a_repair_taking_the_machine_explains_it() -> None:
    repair = Remediation(
        id="gpu-a.1",
        node="gpu-a",
        action=Action.REBOOT,
        requested_action=Action.REBOOT,
        state=RemediationState.RUNNING,
        requester=Requester(kind="human", name="alice"),
        rule="",
        evidence=[],
        created_time=T - timedelta(minutes=1),
        started_time=T - timedelta(seconds=2),
    )
    assert "gpu-a.1" in (platform_cause("gpu-a", T, [], [repair]) or "")
    waiting = msgspec.structs.replace(repair, state=RemediationState.WAITING_IDLE)
    assert platform_cause("gpu-a", T, [], [waiting]) is None

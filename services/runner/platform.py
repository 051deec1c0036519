"""R17: a rank that exits non-zero because of the platform is not the workload's failure.

Sans-I/O: given what the remediator recorded of the rank's machine, did a fault that breaks a
member fire shortly before the rank ended (or while it ran), or was a repair taking the
machine? Then the gang lost a member: it is placed again without the machine, unbilled, as
when the fault itself ended the epoch."""

from __future__ import annotations

from datetime import datetime, timedelta

from libs.contracts.remediation import Alert, AlertState, Remediation, RemediationState

# A GPU falling off the bus kills the rank at once; the driver's Xid line and the monitor's
# scan can come a little after. Faults seen this long after the rank ended are not its cause.
FAULT_WINDOW = timedelta(seconds=60)
TAKING = (RemediationState.RUNNING, RemediationState.REVALIDATING)


def platform_cause(
    node: str,
    ended: datetime,
    alerts: list[Alert],
    remediations: list[Remediation],
    window: timedelta = FAULT_WINDOW,
) -> str | None:
    """Why the platform, not the workload, ended the rank; None if nothing says so."""
    for alert in sorted(alerts, key=lambda a: a.first_seen_time):
        if alert.node != node or not alert.breaks_workload:
            continue
        began = alert.window_start_time
        over = alert.resolved_time if alert.state is AlertState.RESOLVED else None
        if began - window <= ended and (over is None or over + window >= ended):
            return f"{alert.summary} (alert {alert.id}, R17)"
    for rem in remediations:
        if rem.node != node or rem.state not in TAKING:
            continue
        if rem.started_time is not None and rem.started_time - window <= ended:
            return f"remediation {rem.id} ({rem.action.value}) was taking {node}"
    return None

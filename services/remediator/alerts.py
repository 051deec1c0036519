"""From detector findings to alerts (R2, R13), without I/O.

An alert is keyed by node, kind, component and Xid code, so it is stable across reports. It
fires with the first report that has its finding and resolves with the first report from the
same source that does not. Its persistence window starts when it first fires; a signal that
clears and comes back within `flap_memory` keeps the window it had (flapping does not reset
it), while a comeback after that, or after a repair, opens a new episode."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from datetime import datetime, timedelta

import msgspec

from libs.contracts.remediation import (
    MAX_EVIDENCE_ITEMS,
    Alert,
    AlertKind,
    AlertState,
    Evidence,
    Finding,
    SignalReport,
)
from libs.faults.catalog import meaning

_UNSAFE = re.compile(r"[^a-z0-9-]+")


@dataclass(frozen=True, slots=True)
class AlertSettings:
    flap_memory: timedelta = timedelta(minutes=10)


def _token(text: str) -> str:
    cleaned = _UNSAFE.sub("-", text.lower()).strip("-")
    if not cleaned:
        return "root" if text.strip() == "/" else "x"
    if len(cleaned) > 40:  # long components keep a digest so keys stay distinct and short
        cleaned = cleaned[:31] + "-" + hashlib.sha256(text.encode()).hexdigest()[:8]
    return cleaned


def kind_token(kind: AlertKind) -> str:
    return _token(re.sub(r"(?<!^)(?=[A-Z])", "-", kind.value))


def alert_id(node: str, kind: AlertKind, subject: str, xid: int | None = None) -> str:
    """`<node>.<kind>.<component>`, e.g. `gpu-07.xid-79.0000-3b-00`: a valid KV key."""
    head = f"{kind_token(kind)}-{xid}" if xid is not None else kind_token(kind)
    return f"{node}.{head}.{_token(subject)}"


@dataclass(frozen=True, slots=True)
class Placement:
    cluster: str = ""
    pool: str = ""


def next_alert(
    current: Alert | None,
    finding: Finding | None,
    report: SignalReport,
    where: Placement,
    now: datetime,
    settings: AlertSettings,
) -> Alert | None:
    """The alert after one report; None when the report changes nothing (already applied,
    stale, or nothing to resolve). Idempotent: replicas applying one report agree."""
    seen = report.observed_time
    if finding is None:
        if current is None or current.state is AlertState.RESOLVED:
            return None
        if current.last_seen_time > seen:  # an older report than what fired it
            return None
        return msgspec.structs.replace(current, state=AlertState.RESOLVED, resolved_time=seen)
    if current is None:
        return _fired(finding, report, where)
    if current.last_seen_time >= seen or (
        current.resolved_time is not None and current.resolved_time >= seen
    ):
        return None  # this report (or a newer one) was applied already
    if current.state is AlertState.FIRING:
        return msgspec.structs.replace(
            current,
            last_seen_time=seen,
            severity=finding.severity,
            evidence=_merge_evidence(current, [finding.evidence]),
            boot_id=report.boot_id or current.boot_id,
            cluster=current.cluster or where.cluster,
            pool=current.pool or where.pool,
        )
    return _fires_again(current, finding, report, settings)


def _fired(finding: Finding, report: SignalReport, where: Placement) -> Alert:
    seen = report.observed_time
    told = meaning(finding.kind, finding.subject, finding.xid, finding.detail, report.node)
    return Alert(
        id=alert_id(report.node, finding.kind, finding.subject, finding.xid),
        node=report.node,
        cluster=where.cluster,
        pool=where.pool,
        kind=finding.kind,
        subject=finding.subject,
        xid=finding.xid,
        severity=finding.severity,
        summary=told.summary,
        description=f"{told.description} Seen: {finding.detail.rstrip('.')}."[:2000],
        source=report.source,
        action=told.action,
        state=AlertState.FIRING,
        first_seen_time=seen,
        last_seen_time=seen,
        window_start_time=seen,
        evidence=[finding.evidence],
        boot_id=report.boot_id,
        breaks_workload=told.breaks_workload,
    )


def _fires_again(
    current: Alert, finding: Finding, report: SignalReport, settings: AlertSettings
) -> Alert:
    """A resolved alert fires again: within the flap memory it is the same alert flapping;
    after it, a new generation whose window starts over."""
    seen = report.observed_time
    evidence = [finding.evidence]
    resolved = current.resolved_time or current.last_seen_time
    if seen - resolved <= settings.flap_memory:
        return msgspec.structs.replace(
            current,
            state=AlertState.FIRING,
            last_seen_time=seen,
            resolved_time=None,
            flaps=current.flaps + 1,
            severity=finding.severity,
            evidence=_merge_evidence(current, evidence),
            boot_id=report.boot_id or current.boot_id,
        )
    return msgspec.structs.replace(
        current,
        state=AlertState.FIRING,
        first_seen_time=seen,
        last_seen_time=seen,
        window_start_time=seen,
        resolved_time=None,
        flaps=0,
        generation=current.generation + 1,
        severity=finding.severity,
        evidence=evidence,
        boot_id=report.boot_id or current.boot_id,
    )


def _merge_evidence(current: Alert, new: list[Evidence]) -> list[Evidence]:
    """The newest evidence per (source, where), at most MAX_EVIDENCE_ITEMS."""
    kept = {(e.source, e.where, tuple(sorted(e.labels.items()))): e for e in current.evidence}
    for item in new:
        kept[(item.source, item.where, tuple(sorted(item.labels.items())))] = item
    return sorted(kept.values(), key=lambda e: e.observed_time)[-MAX_EVIDENCE_ITEMS:]


def after_repair(alert: Alert, generation: int, now: datetime) -> Alert | None:
    """A repair for this alert's `generation` ended: its next remediation gets a new id, and if
    the fault recurs it must persist again for its window before it is recommended (R13)."""
    if alert.generation != generation:
        return None
    return msgspec.structs.replace(
        alert, generation=alert.generation + 1, window_start_time=max(now, alert.window_start_time)
    )


def report_changes(report: SignalReport, firing: list[Alert]) -> list[tuple[str, Finding | None]]:
    """Which alerts one report touches: every finding, and every firing alert of the same node
    and source that the report no longer has (it resolves)."""
    touched: dict[str, Finding | None] = {}
    for finding in report.findings:
        touched[alert_id(report.node, finding.kind, finding.subject, finding.xid)] = finding
    for alert in firing:
        if alert.node == report.node and alert.source == report.source:
            touched.setdefault(alert.id, None)
    return list(touched.items())

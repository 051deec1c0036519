"""From a persisting alert to a recommendation, and from a request to the action that runs
(R3, R4, R10, R11), without I/O."""

from __future__ import annotations

from datetime import datetime

from libs.contracts.remediation import (
    Action,
    Alert,
    AlertKind,
    AlertState,
    Evidence,
    Ladder,
    Recommendation,
)
from libs.faults.catalog import breaks_workload_rule
from services.remediator import ladder as ladders
from services.remediator.guardrails import Settings, persisted


def has_failed_check(evidence: list[Evidence]) -> bool:
    """R3: a repair needs a failed health check; NotReady (a missing heartbeat) alone is not
    one, and evidence without raw lines or values proves nothing."""
    return any(e.kind is not AlertKind.NODE_NOT_READY and (e.lines or e.values) for e in evidence)


def has_critical(evidence: list[Evidence]) -> bool:
    return any(e.severity == "critical" for e in evidence)


def effective_action(requested: Action, evidence: list[Evidence]) -> tuple[Action, str]:
    """R11: migration needs critical-alert evidence; without it, it runs as quick reprovision."""
    if requested is Action.MIGRATE and not has_critical(evidence):
        return (
            Action.REPROVISION,
            "no critical-alert evidence, so Migrate runs as quick Reprovision (R11)",
        )
    return requested, ""


def recommend(
    alert: Alert,
    ladder: Ladder | None,
    now: datetime,
    settings: Settings,
    current: Recommendation | None = None,
) -> Recommendation | None:
    """The recommendation this alert should have now; None when it should have none: not
    firing (it disappears when its alert clears, R13), nothing to repair, no failed check, or
    not persisted for its window yet."""
    if alert.state is not AlertState.FIRING or alert.action is Action.NONE:
        return None
    if not has_failed_check(alert.evidence):
        return None
    if not persisted(alert.window_start_time, alert.kind, now, settings):
        return None
    key = ladders.ladder_key(alert.node, alert.cluster, alert.kind, alert.xid)
    climbed, why = ladders.escalate(alert.action, ladder, now)
    action = climbed
    _, r11 = effective_action(climbed, alert.evidence)
    rule = f"{alert.kind.value}"
    if alert.xid is not None:
        rule += f" {alert.xid}"
    rule += f" -> {alert.action.value} (lightest action that fixes it, R4)"
    for step in [*why, r11]:
        if step:
            rule += f"; {step}"
    if alert.breaks_workload:
        rule += f"; {breaks_workload_rule(alert.summary)}"
    # the recommendation of this generation of the alert, as it stands
    same = current if current is not None and current.generation == alert.generation else None
    if same is not None and same.action is action and same.rule == rule:
        return same
    return Recommendation(
        id=alert.id,
        alert_id=alert.id,
        node=alert.node,
        cluster=alert.cluster,
        pool=alert.pool,
        kind=alert.kind,
        xid=alert.xid,
        action=action,
        base_action=alert.action,
        rule=rule,
        summary=alert.summary,
        severity=alert.severity,
        generation=alert.generation,
        created_time=same.created_time if same is not None else now,
        ladder_key=key,
        evidence=alert.evidence,
        remediation_id=same.remediation_id if same is not None else None,
        breaks_workload=alert.breaks_workload,
    )

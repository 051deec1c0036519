"""The escalation ladder (R9, R10), without I/O.

Rungs, lightest first: reboot (PowerCycle is the reboot rung with GPU power loss), quick
reprovision, migrate, delete. After the same action ran twice on one machine for one kind of
fault (and one Xid code) and the fault came back, the next recommendation is one rung up.
Attempts older than a week, cancelled, or whose alert resolved on its own do not count."""

from __future__ import annotations

from datetime import datetime, timedelta

import msgspec

from libs.contracts.remediation import (
    Action,
    AlertKind,
    Ladder,
    LadderAttempt,
    Outcome,
)
from services.remediator.alerts import kind_token

WEEK = timedelta(days=7)
RUNG: dict[Action, int] = {
    Action.REBOOT: 0,
    Action.POWER_CYCLE: 0,
    Action.REPROVISION: 1,
    Action.MIGRATE: 2,
    Action.DELETE: 3,
}
UP: dict[Action, Action] = {
    Action.REBOOT: Action.REPROVISION,
    Action.POWER_CYCLE: Action.REPROVISION,
    Action.REPROVISION: Action.MIGRATE,
    Action.MIGRATE: Action.DELETE,
}
TIMES_BEFORE_UP = 2


def ladder_key(node: str, cluster: str, kind: AlertKind, xid: int | None) -> str:
    return f"{node}.{cluster or 'none'}.{kind_token(kind)}.{xid if xid is not None else 'none'}"


def counts(attempt: LadderAttempt, now: datetime) -> bool:
    return attempt.outcome in (Outcome.DONE, Outcome.FAILED) and now - attempt.time <= WEEK


def escalate(base: Action, ladder: Ladder | None, now: datetime) -> tuple[Action, list[str]]:
    """The rung to recommend, and why, in words."""
    action = base
    why: list[str] = []
    if ladder is None or action is Action.NONE:
        return action, why
    while action in UP:
        ran = sum(1 for a in ladder.attempts if a.action is action and counts(a, now))
        if ran < TIMES_BEFORE_UP:
            break
        up = UP[action]
        why.append(
            f"{action.value} already ran {ran} times on this machine for this fault within a "
            f"week and it came back: one rung up to {up.value} (R10)"
        )
        action = up
    return action, why


def record(
    ladder: Ladder | None,
    key: str,
    node: str,
    cluster: str,
    kind: AlertKind,
    xid: int | None,
    attempt: LadderAttempt,
    now: datetime,
) -> Ladder | None:
    """The ladder with one more attempt; None when this remediation is recorded already.
    Attempts too old to count are dropped."""
    if ladder is None:
        ladder = Ladder(key=key, node=node, cluster=cluster, kind=kind, xid=xid)
    if any(a.remediation_id == attempt.remediation_id for a in ladder.attempts):
        return None
    kept = [a for a in ladder.attempts if now - a.time <= WEEK]
    return msgspec.structs.replace(ladder, attempts=[*kept, attempt])

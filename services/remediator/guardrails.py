"""Guardrails against alert storms (R13) and external detectors (R8), without I/O.

- persistence: a signal becomes a recommendation only after it persisted for its window;
- cooldown: a node is not repaired again within `cooldown` of its last repair;
- budget: at most `budget(cluster size)` repairs run at once in a cluster;
- one repair at a time per node pool, and per node;
- breaker: a surge of automatic repairs in one cluster opens it; it stays open until a person
  resets it, and what it held back goes back to a person instead of being replayed;
- external requests: at most `external_cap` active per cluster, and a capacity floor."""

from __future__ import annotations

import math
from collections.abc import Container
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import msgspec

from libs.contracts.remediation import (
    AlertKind,
    Breaker,
    BreakerEntry,
    RepairSlots,
)


@dataclass(frozen=True, slots=True)
class Settings:
    """Guardrail settings (`nodus remediator` flags); defaults for a production cluster."""

    persistence: timedelta = timedelta(minutes=2)
    persistence_by_kind: dict[AlertKind, timedelta] = field(default_factory=dict)
    cooldown: timedelta = timedelta(minutes=30)
    budget_fraction: float = 0.05  # of the cluster's nodes repaired at once
    budget_min: int = 1
    breaker_surge: int = 5  # automatic repairs within the window that open the breaker
    breaker_fraction: float = 0.02  # or this share of the cluster, whichever is larger
    breaker_window: timedelta = timedelta(minutes=10)
    external_cap: int = 3  # active external repairs per cluster
    min_available_fraction: float = 0.5  # never take more of a cluster out of service
    action_timeout: timedelta = timedelta(minutes=15)  # a machine that does not come back
    slot_grace: timedelta = timedelta(seconds=30)  # a slot held by no record is stale after
    claim_grace: timedelta = timedelta(seconds=30)  # another replica's claim to issue an action

    def persistence_for(self, kind: AlertKind) -> timedelta:
        return self.persistence_by_kind.get(kind, self.persistence)


def persisted(window_start: datetime, kind: AlertKind, now: datetime, settings: Settings) -> bool:
    return now - window_start >= settings.persistence_for(kind)


def budget(cluster_size: int, settings: Settings) -> int:
    return max(settings.budget_min, math.floor(cluster_size * settings.budget_fraction))


def surge(cluster_size: int, settings: Settings) -> int:
    return max(settings.breaker_surge, math.ceil(cluster_size * settings.breaker_fraction))


def cooldown_until(last_repair: datetime | None, settings: Settings) -> datetime | None:
    return None if last_repair is None else last_repair + settings.cooldown


def breaker_admit(
    breaker: Breaker | None,
    cluster: str,
    remediation_id: str,
    cluster_size: int,
    now: datetime,
    settings: Settings,
) -> tuple[Breaker | None, bool]:
    """Count one more automatic repair. Returns the breaker to write (None: unchanged) and
    whether the repair may go ahead automatically."""
    current = breaker or Breaker(cluster=cluster)
    if current.open:
        return None, False
    if any(entry.remediation_id == remediation_id for entry in current.recent):
        return None, True  # counted already (a retry, or the other replica)
    recent = [e for e in current.recent if now - e.time <= settings.breaker_window]
    limit = surge(cluster_size, settings)
    if len(recent) + 1 > limit:
        return (
            msgspec.structs.replace(
                current,
                open=True,
                recent=recent,
                opened_time=now,
                opened_reason=(
                    f"{len(recent) + 1} automatic repairs in cluster {cluster} within "
                    f"{settings.breaker_window} (surge limit {limit}): automatic repairs stop "
                    "until a person resets the breaker"
                ),
                trips=current.trips + 1,
                held=[*current.held, remediation_id][-1000:],
            ),
            False,
        )
    entry = BreakerEntry(remediation_id=remediation_id, time=now)
    return msgspec.structs.replace(current, recent=[*recent, entry]), True


def breaker_hold(breaker: Breaker, remediation_id: str) -> Breaker | None:
    if remediation_id in breaker.held:
        return None
    return msgspec.structs.replace(breaker, held=[*breaker.held, remediation_id])


def breaker_reset(breaker: Breaker | None, cluster: str, by: str, now: datetime) -> Breaker:
    """Closed by a person. What it held stays with people: nothing is replayed."""
    current = breaker or Breaker(cluster=cluster)
    return msgspec.structs.replace(
        current, open=False, recent=[], reset_by=by, reset_time=now, opened_reason=""
    )


def take_slot(
    slots: RepairSlots | None,
    scope: str,
    holder: str,
    limit: int,
    live: Container[str],
    now: datetime,
    grace: timedelta,
) -> RepairSlots | None:
    """The slots with `holder` in them; None when they are full. Holders that are no longer
    live (their repair ended or never got written) are dropped after `grace`."""
    current = slots or RepairSlots(scope=scope)
    holders = {h: since for h, since in current.holders.items() if h in live or now - since < grace}
    if holder in holders:
        if holders == current.holders:
            return current
        return msgspec.structs.replace(current, holders=holders)
    if len(holders) >= limit:
        return None
    holders[holder] = now
    return msgspec.structs.replace(current, holders=holders)


def release_slot(slots: RepairSlots | None, holder: str) -> RepairSlots | None:
    """None when there is nothing to release."""
    if slots is None or holder not in slots.holders:
        return None
    return msgspec.structs.replace(
        slots, holders={h: t for h, t in slots.holders.items() if h != holder}
    )

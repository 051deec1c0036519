"""Repair slots on the bus (R13): one repair at a time per node and per node pool, and the
concurrency budget of a cluster. A slot is a holder in a `RepairSlots` record, taken and released
with compare-and-set, so replicas that race count exactly."""

from __future__ import annotations

from datetime import datetime

from libs.contracts.remediation import Remediation, RemediationState, RepairSlots
from services.remediator import guardrails
from services.remediator.store import Refused, Store, View


class Slots:
    def __init__(self, store: Store, settings: guardrails.Settings) -> None:
        self.store = store
        self.settings = settings
        self._live = _Live(store.rems, starting=False)
        self._live_starting = _Live(store.rems, starting=True)

    async def take(self, scope: str, holder: str, limit: int, now: datetime) -> bool:
        def change(current: RepairSlots | None) -> RepairSlots | None:
            live = self._live if scope.startswith("node.") else self._live_starting
            taken = guardrails.take_slot(
                current, scope, holder, limit, live, now, self.settings.slot_grace
            )
            if taken is None:
                raise Refused
            return None if taken is current else taken

        try:
            await self.store.mutate(
                self.store.slot_bucket, self.store.slots, scope, change, exact=True
            )
        except Refused:
            return False
        return True

    async def release(self, scope: str, holder: str) -> None:
        await self.store.mutate(
            self.store.slot_bucket,
            self.store.slots,
            scope,
            lambda current: guardrails.release_slot(current, holder),
            exact=True,
        )


class _Live:
    """Holders of slots that still hold them: a node's slot belongs to any repair not ended;
    a pool's or a cluster's only to repairs starting or under way (not back with a person)."""

    STARTING = frozenset(
        {RemediationState.WAITING_IDLE, RemediationState.RUNNING, RemediationState.REVALIDATING}
    )

    def __init__(self, rems: View[Remediation], starting: bool) -> None:
        self._rems = rems
        self._starting = starting

    def __contains__(self, holder: object) -> bool:
        found = self._rems.get(str(holder))
        if found is None:
            return False
        if self._starting:
            return found.value.state in self.STARTING
        return found.value.active

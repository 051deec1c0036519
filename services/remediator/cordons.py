"""Cordons the remediator places and lifts (R13, R15): its own hold while a repair is approved
or under way, the retired hold of a deleted machine. It never lifts a hold that someone else
placed."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

import msgspec

from libs.contracts.remediation import (
    Action,
    Cordon,
    CordonHold,
    Remediation,
    RemediationState,
)
from services.remediator.store import Store

REMEDIATOR_HOLD = "remediator"  # the remediator's cordon hold; it never lifts anyone else's
RETIRED_HOLD = "retired"


class Cordons:
    def __init__(self, store: Store) -> None:
        self.store = store

    def retired(self, node: str) -> bool:
        cordon = self.store.cordons.get(node)
        return cordon is not None and RETIRED_HOLD in cordon.value.holds

    async def hold(self, rem: Remediation, now: datetime) -> None:
        """The remediator's hold for this repair (one at a time: it replaces an older one)."""
        reason = f"{rem.action.value} by remediation {rem.id}"
        await self._place(
            rem, REMEDIATOR_HOLD, reason, now, lambda held: held.remediation_id == rem.id
        )

    async def hold_forever(self, rem: Remediation, now: datetime) -> None:
        """The retired hold of a deleted machine; the first one stays."""
        reason = f"retired by remediation {rem.id}"
        await self._place(rem, RETIRED_HOLD, reason, now, lambda held: True)

    async def _place(
        self,
        rem: Remediation,
        by: str,
        reason: str,
        now: datetime,
        kept: Callable[[CordonHold], bool],
    ) -> None:
        """Places the hold `by` on the repair's node unless the hold there is `kept`."""
        hold = CordonHold(by=by, reason=reason, time=now, remediation_id=rem.id)

        def change(current: Cordon | None) -> Cordon | None:
            cordon = current or Cordon(node=rem.node)
            held = cordon.holds.get(by)
            if held is not None and kept(held):
                return None
            return msgspec.structs.replace(cordon, holds={**cordon.holds, by: hold})

        await self.store.mutate(self.store.cordon_bucket, self.store.cordons, rem.node, change)

    async def lift(self, node: str) -> None:
        """Lifts the remediator's own hold only, and only when no approved repair of the node
        still needs it; holds placed by anyone else stay."""
        if any(r.state is not RemediationState.PENDING for r in self.store.active_of(node)):
            return

        def change(current: Cordon | None) -> Cordon | None:
            if current is None or REMEDIATOR_HOLD not in current.holds:
                return None
            holds = {k: v for k, v in current.holds.items() if k != REMEDIATOR_HOLD}
            return msgspec.structs.replace(current, holds=holds)

        await self.store.mutate(self.store.cordon_bucket, self.store.cordons, node, change)

    async def lift_if_healthy(self, node: str) -> None:
        """A hold kept after a failed repair goes once the node has no active repair and no
        firing alert that needs one."""
        cordon = self.store.cordons.get(node)
        if (
            cordon is None
            or REMEDIATOR_HOLD not in cordon.value.holds
            or self.store.active_of(node)
        ):
            return
        if any(a.action is not Action.NONE for a in self.store.firing_of(node)):
            return
        await self.lift(node)

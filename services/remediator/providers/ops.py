"""The ledger of what real providers carried out (bucket `nodus-provider-ops`, key = op id).

A record is created with compare-and-set before an action runs: the replica whose create wins
runs it, every other one reads the answer recorded there (R14)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

import msgspec

from libs.bus import Bus
from libs.contracts import names
from libs.contracts.providers import ProviderKind, ProviderOp
from libs.contracts.remediation import Action

MAX_TEXT = 4096  # bytes of a command's stdout kept; stderr keeps its tail of this size


def tail(text: str, limit: int = MAX_TEXT) -> str:
    return text if len(text) <= limit else "..." + text[-limit:]


class Ledger:
    def __init__(self, bus: Bus, replica: str, clock: Callable[[], datetime]) -> None:
        self.bucket = bus.bucket(names.BUCKET_PROVIDER_OPS, ProviderOp)
        self.replica = replica
        self.clock = clock

    async def get(self, op_id: str) -> ProviderOp | None:
        found = await self.bucket.get(op_id)
        return found.value if found else None

    async def done(self, op_id: str) -> bool:
        op = await self.get(op_id)
        return op is not None and op.state == "Done"

    async def claim(
        self, op_id: str, node: str, action: Action, kind: ProviderKind
    ) -> tuple[ProviderOp, bool]:
        """(the record, whether this replica claimed it now)."""
        op = ProviderOp(
            op_id=op_id,
            node=node,
            action=action,
            provider=kind,
            state="Running",
            replica=self.replica,
            claim_time=self.clock(),
        )
        if await self.bucket.create(op_id, op) is not None:
            return op, True
        current = await self.get(op_id)
        assert current is not None  # created by someone else; records are never deleted
        return current, False

    async def update(self, op_id: str, **changes: object) -> None:
        def change(current: ProviderOp | None) -> ProviderOp | None:
            return None if current is None else msgspec.structs.replace(current, **changes)

        await self.bucket.mutate(op_id, change)

    async def finish(self, op_id: str, ok: bool, answer: str, **changes: object) -> None:
        await self.update(
            op_id,
            state="Done" if ok else "Failed",
            finished_time=self.clock(),
            answer=tail(answer, 1024),
            **changes,
        )

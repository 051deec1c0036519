"""Who may talk to whom: members' WireGuard keys per gang epoch, and fenced epochs (S2, G9)."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

from libs.bus import Bus
from libs.contracts import names
from libs.contracts.epochs import Epoch
from libs.contracts.relay import Member
from libs.wg import key_from_base64

log = logging.getLogger("nodus.relay.membership")


@dataclass(frozen=True, slots=True)
class Identity:
    gang: str
    epoch: int
    node: str
    members: int  # the gang's size, for its per-member rate


class Membership:
    """Kept from KV watches; answers "is this key a live member, and of which gang epoch?"."""

    def __init__(self, bus: Bus) -> None:
        self.members = bus.bucket(names.BUCKET_MEMBERS, Member)
        self.epochs = bus.bucket(names.BUCKET_EPOCHS, Epoch)
        self.by_key: dict[bytes, Identity] = {}
        self.sizes: dict[tuple[str, int], int] = {}
        self.fenced: set[tuple[str, int]] = set()
        self.on_fence: list[Callable[[str, int], None]] = []
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        ready = [asyncio.Event(), asyncio.Event()]
        self._tasks = [
            asyncio.create_task(self._watch_epochs(ready[0])),
            asyncio.create_task(self._watch_members(ready[1])),
        ]
        await asyncio.gather(*(event.wait() for event in ready))

    async def stop(self) -> None:
        from libs.runtime.tasks import cancel_and_wait

        await cancel_and_wait(self._tasks)

    def identity(self, key: bytes) -> Identity | None:
        found = self.by_key.get(key)
        if found is None or (found.gang, found.epoch) in self.fenced:
            return None
        return found

    async def admit(self, key: bytes, gang: str, epoch: int, node: str) -> Identity | None:
        """`identity(key)`, or, when the watches have not delivered the member yet (just
        joined, or a watch catching up after the bus failed over), the records read now."""
        found = self.identity(key)
        if found is not None or (gang, epoch) in self.fenced or not _names_a_member(gang, node):
            return found
        member = await self.members.get(names.member_key(gang, epoch, node))
        record = await self.epochs.get(names.epoch_key(gang, epoch))
        if member is None or record is None or record.value.fenced:
            return None
        try:
            if key_from_base64(member.value.wg_public_key) != key:
                return None
        except ValueError:
            return None
        identity = Identity(gang, epoch, node, len(record.value.members))
        self.sizes[(gang, epoch)] = len(record.value.members)
        self.by_key[key] = identity
        return identity

    def same_epoch(self, src: bytes, dst: bytes) -> bool:
        a, b = self.identity(src), self.identity(dst)
        return a is not None and b is not None and (a.gang, a.epoch) == (b.gang, b.epoch)

    async def _watch_epochs(self, ready: asyncio.Event) -> None:
        async for change in self.epochs.watch(caught_up=ready):
            epoch = change.value
            if epoch is None:
                continue
            key = (epoch.gang, epoch.epoch)
            self.sizes[key] = len(epoch.members)
            if epoch.fenced and key not in self.fenced:
                self.fenced.add(key)
                for callback in self.on_fence:
                    callback(*key)

    async def _watch_members(self, ready: asyncio.Event) -> None:
        async for change in self.members.watch(caught_up=ready):
            member = change.value
            if member is None:
                self.by_key = {k: v for k, v in self.by_key.items() if _kv_key(v) != change.key}
                continue
            try:
                raw = key_from_base64(member.wg_public_key)
            except ValueError:  # S3: a malformed record admits nobody, and is said so
                log.warning("member record %s: its WireGuard key is malformed", change.key)
                continue
            size = self.sizes.get((member.gang, member.epoch), 2)
            self.by_key[raw] = Identity(member.gang, member.epoch, member.node, size)


_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def _names_a_member(gang: str, node: str) -> bool:
    """A hello's names are the peer's words: only `org.name` and a node name are looked up
    (S3), never a key pattern."""
    parts = gang.split(".")
    return len(parts) == 2 and all(_LABEL.match(p) for p in [*parts, node])


def _kv_key(identity: Identity) -> str:
    return names.member_key(identity.gang, identity.epoch, identity.node)

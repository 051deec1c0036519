"""Usage: bytes each member sends through this relay, published to the usage stream (G17), late
at worst, never lost and never doubled.

Every count lives in a journal: a small file mapped into memory, one slot per (gang, epoch,
node) holding what was metered, what was published, and the record being published. A
metered frame is one store into that mapping, so what a relay metered survives its process
being killed (the pages belong to the kernel); a relay that starts again on the same journal
publishes what its last life metered and never published.

A slot also keeps the highest total the member said it sent (`Sent`): what its programs sent,
counted once, which the bill prefers to the relays' own counts when they agree within a
bound (libs/contracts/relay.py: billed_bytes).

A record is prepared in the journal before it is published (seq, bytes, the member's total)
and published with
the id `relay:journal:gang:epoch:node:seq`; a retry, in this life or the next, republishes
the very same record, so the stream's de-duplication lands it once. Without a journal file
(tests, benchmarks) the journal lives in anonymous memory and a killed relay loses at most
one flush interval.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import secrets
import struct
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from libs.bus import Bus
from libs.contracts import names
from libs.contracts.relay import UsageRecord
from services.relay.metrics import USAGE_FLUSHES

log = logging.getLogger("nodus.relay.billing")

Key = tuple[str, int, str]  # gang, epoch, node

MAGIC = b"NODUSUJ2"
HEADER = struct.Struct("<8s16sI")  # magic, journal id, slot count
SLOT_SIZE = 512
SLOT_HEAD = struct.Struct("<BH")  # in use, key length
SLOT_KEY_MAX = 256  # org.name (127) + epoch + node (63), with room
# counted, published, seq (of the last record prepared), acknowledged seq, bytes of record
# `seq`, since (unix seconds of the unpublished period), the member's own total (`Sent`), and
# the total record `seq` carries
SLOT_NUMBERS = struct.Struct("<QQQQQdQQ")
NUMBERS_AT = SLOT_HEAD.size + SLOT_KEY_MAX
COUNTED = struct.Struct("<Q")
REPORTED_AT = NUMBERS_AT + 6 * 8
FIRST_SLOTS = 1024

# The first layout (256-byte slots, no member totals): read once, then written anew.
V1_MAGIC = b"NODUSUJ1"
V1_SLOT_SIZE = 256
V1_NUMBERS_AT = SLOT_HEAD.size + 200
V1_NUMBERS = struct.Struct("<QQQQd")  # counted, published, seq, in-flight bytes, since


@dataclass(slots=True)
class Slot:
    index: int
    counted: int = 0
    published: int = 0
    seq: int = 0  # the last record prepared; it is unacknowledged while seq > acked
    acked: int = 0
    inflight: int = 0  # bytes of record `seq`
    since: float = 0.0
    reported: int = 0  # the highest total the member said it sent (`Sent`)
    record_reported: int = 0  # the total record `seq` carries

    @property
    def pending(self) -> bool:
        return self.seq > self.acked


class Journal:
    """The slots, in a mapped file (or anonymous memory when `path` is None)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.slots: dict[Key, Slot] = {}
        self._fd: int | None = None
        if path is None:
            self._create_anonymous()
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() and path.stat().st_size and _magic(path) == V1_MAGIC:
            self._upgrade_v1(path)
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        size = os.fstat(self._fd).st_size
        if size == 0:
            os.ftruncate(self._fd, HEADER.size + FIRST_SLOTS * SLOT_SIZE)
            self._map = mmap.mmap(self._fd, 0)
            self.id = secrets.token_hex(8)
            self.capacity = FIRST_SLOTS
            self._write_header()
        else:
            self._map = mmap.mmap(self._fd, 0)
            magic, raw_id, capacity = HEADER.unpack_from(self._map, 0)
            if magic != MAGIC or size < HEADER.size + capacity * SLOT_SIZE:
                raise ValueError(f"{path} is not a relay usage journal (or is truncated)")
            self.id = raw_id.decode().rstrip("\x00")
            self.capacity = capacity
            self._load()

    def _create_anonymous(self, capacity: int = FIRST_SLOTS, journal_id: str = "") -> None:
        self.id = journal_id or secrets.token_hex(8)
        self._map = mmap.mmap(-1, HEADER.size + capacity * SLOT_SIZE)
        self.capacity = capacity
        self._write_header()

    def _upgrade_v1(self, path: Path) -> None:
        """A journal of the first layout: its slots (what its relay metered and did not publish
        yet) are written in this layout under the same id, then replace it in one rename."""
        raw = path.read_bytes()
        _, raw_id, capacity = HEADER.unpack_from(raw, 0)
        if len(raw) < HEADER.size + capacity * V1_SLOT_SIZE:
            raise ValueError(f"{path} is a truncated relay usage journal")
        self._create_anonymous(max(capacity, FIRST_SLOTS), raw_id.decode().rstrip("\x00"))
        for index in range(capacity):
            at = HEADER.size + index * V1_SLOT_SIZE
            used, length = SLOT_HEAD.unpack_from(raw, at)
            if not used:
                continue
            gang, epoch, node = (
                raw[at + SLOT_HEAD.size : at + SLOT_HEAD.size + length].decode().split("\x00")
            )
            counted, published, seq, inflight, since = V1_NUMBERS.unpack_from(
                raw, at + V1_NUMBERS_AT
            )
            slot = self.slot((gang, int(epoch), node))
            slot.counted, slot.published, slot.seq, slot.inflight, slot.since = (
                counted,
                published,
                seq,
                inflight,
                since,
            )
            slot.acked = seq - 1 if inflight else seq
            self._store(slot)
        upgraded = path.with_suffix(path.suffix + ".v2")
        upgraded.write_bytes(self._map[:])
        os.chmod(upgraded, 0o600)
        os.replace(upgraded, path)
        self._map.close()
        self.slots.clear()
        log.info("usage journal %s: upgraded to the layout with members' own totals", path)

    def _write_header(self) -> None:
        HEADER.pack_into(self._map, 0, MAGIC, self.id.encode(), self.capacity)

    def _offset(self, index: int) -> int:
        return HEADER.size + index * SLOT_SIZE

    def _load(self) -> None:
        for index in range(self.capacity):
            at = self._offset(index)
            used, length = SLOT_HEAD.unpack_from(self._map, at)
            if not used:
                continue
            raw = bytes(self._map[at + SLOT_HEAD.size : at + SLOT_HEAD.size + length])
            gang, epoch, node = raw.decode().split("\x00")
            numbers = SLOT_NUMBERS.unpack_from(self._map, at + NUMBERS_AT)
            self.slots[(gang, int(epoch), node)] = Slot(index, *numbers)

    def slot(self, key: Key) -> Slot:
        found = self.slots.get(key)
        if found is not None:
            return found
        raw = f"{key[0]}\x00{key[1]}\x00{key[2]}".encode()
        if len(raw) > SLOT_KEY_MAX:
            raise ValueError(f"usage key too long: {key}")
        used = {s.index for s in self.slots.values()}
        index = next((i for i in range(self.capacity) if i not in used), None)
        if index is None:
            index = self.capacity
            self._grow()
        slot = Slot(index, since=time.time())
        at = self._offset(index)
        self._map[at : at + SLOT_SIZE] = bytes(SLOT_SIZE)
        self._map[at + SLOT_HEAD.size : at + SLOT_HEAD.size + len(raw)] = raw
        self._store(slot)
        SLOT_HEAD.pack_into(self._map, at, 1, len(raw))
        self.slots[key] = slot
        return slot

    def _grow(self) -> None:
        capacity = self.capacity * 2
        size = HEADER.size + capacity * SLOT_SIZE
        if self._fd is None:
            bigger = mmap.mmap(-1, size)
            bigger[: len(self._map)] = self._map[:]
            self._map.close()
            self._map = bigger
        else:
            os.ftruncate(self._fd, size)
            self._map.resize(size)
        self.capacity = capacity
        self._write_header()

    def count(self, slot: Slot, size: int) -> None:
        """The hot path: one store per metered read."""
        slot.counted += size
        COUNTED.pack_into(self._map, self._offset(slot.index) + NUMBERS_AT, slot.counted)

    def report(self, slot: Slot, total: int) -> None:
        """The member's own total: the highest one told is kept."""
        if total > slot.reported:
            slot.reported = total
            COUNTED.pack_into(self._map, self._offset(slot.index) + REPORTED_AT, total)

    def _store(self, slot: Slot) -> None:
        SLOT_NUMBERS.pack_into(
            self._map,
            self._offset(slot.index) + NUMBERS_AT,
            slot.counted,
            slot.published,
            slot.seq,
            slot.acked,
            slot.inflight,
            slot.since,
            slot.reported,
            slot.record_reported,
        )

    def due(self, slot: Slot) -> bool:
        """Something metered or told that no record holds yet."""
        return slot.counted > slot.published or slot.reported > slot.record_reported

    def prepare(self, slot: Slot) -> None:
        """Fix the next record (seq, bytes, the member's total) in the journal before it is
        published; it covers the time from `since` to its publication."""
        slot.seq += 1
        slot.inflight = slot.counted - slot.published
        slot.record_reported = slot.reported
        self._store(slot)

    def published(self, slot: Slot, now: float) -> None:
        slot.published += slot.inflight
        slot.inflight = 0
        slot.acked = slot.seq
        slot.since = now
        self._store(slot)

    def forget(self, key: Key) -> None:
        """A slot with nothing left to publish, for a key no longer metered."""
        slot = self.slots.pop(key)
        SLOT_HEAD.pack_into(self._map, self._offset(slot.index), 0, 0)

    def close(self) -> None:
        if self._map.closed:
            return
        self._map.flush()
        self._map.close()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _magic(path: Path) -> bytes:
    with path.open("rb") as file:
        return file.read(len(MAGIC))


class UsageMeter:
    def __init__(
        self,
        bus: Bus,
        relay: str,
        journal_path: Path | None = None,
        interval: float = 0.1,
        idle_forget: float = 600.0,
    ) -> None:
        self.bus = bus
        self.relay = relay
        self.interval = interval
        self.idle_forget = idle_forget
        self.journal = Journal(journal_path)
        self._seen: dict[Key, tuple[int, float]] = {}  # counted at the last flush, and when
        recovered = sum(s.counted - s.published for s in self.journal.slots.values())
        if recovered:
            log.info(
                "usage journal %s: %d bytes metered by an earlier run are not published yet; "
                "publishing them now",
                journal_path,
                recovered,
            )

    @property
    def boot(self) -> str:
        return self.journal.id

    @property
    def counts(self) -> dict[Key, int]:
        """Bytes metered and not yet in an acknowledged record, per key."""
        return {k: s.counted - s.published for k, s in self.journal.slots.items()}

    def add(self, gang: str, epoch: int, node: str, size: int) -> None:
        self.journal.count(self.journal.slot((gang, epoch, node)), size)

    def report(self, gang: str, epoch: int, node: str, total: int) -> None:
        """The member's own count of what its programs sent (billed_bytes weighs it)."""
        self.journal.report(self.journal.slot((gang, epoch, node)), total)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.flush()

    async def flush(self) -> None:
        now = time.time()
        for key, slot in list(self.journal.slots.items()):
            if not slot.pending and self.journal.due(slot):
                self.journal.prepare(slot)
            if slot.pending:
                if await self._publish(key, slot, now):
                    self.journal.published(slot, now)
                continue
            counted, since = self._seen.get(key, (-1, now))
            if counted != slot.counted + slot.reported:
                self._seen[key] = (slot.counted + slot.reported, now)
            elif now - since > self.idle_forget:  # all published, and quiet for long
                self.journal.forget(key)
                del self._seen[key]

    async def _publish(self, key: Key, slot: Slot, now: float) -> bool:
        gang, epoch, node = key
        record = UsageRecord(
            relay=self.relay,
            boot=self.journal.id,
            gang=gang,
            epoch=epoch,
            node=node,
            seq=slot.seq,
            bytes_sent=slot.inflight,
            reported=slot.record_reported,
            start_time=datetime.fromtimestamp(slot.since or now, UTC),
            end_time=datetime.fromtimestamp(now, UTC),
        )
        dedup = f"{self.relay}:{self.journal.id}:{gang}:{epoch}:{node}:{slot.seq}"
        try:
            await self.bus.publish(names.usage_subject(self.relay, gang), record, dedup)
        except Exception as error:  # kept prepared; the next flush retries the same record
            USAGE_FLUSHES.labels("retry").inc()
            log.warning("usage record %s not published yet: %s", dedup, error)
            return False
        USAGE_FLUSHES.labels("published").inc()
        return True

    def close(self) -> None:
        self.journal.close()

"""Usage: bytes each member sends through this relay, flushed to the usage stream (G17).

Each flush is a record with the id `relay:boot:gang:epoch:node:seq`; a record whose publish
failed is retried unchanged (same id, same bytes), so the stream's de-duplication makes a
retry land once. A graceful stop flushes everything; a killed relay loses at most one
interval of counts (the flush interval, 1 s by default)."""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime

from libs.bus import Bus
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.relay import UsageRecord
from services.relay.metrics import USAGE_FLUSHES

log = logging.getLogger("nodus.relay.billing")

Key = tuple[str, int, str]  # gang, epoch, node


class UsageMeter:
    def __init__(self, bus: Bus, relay: str, boot: str, interval: float = 1.0) -> None:
        self.bus = bus
        self.relay = relay
        self.boot = boot
        self.interval = interval
        self.counts: dict[Key, int] = {}
        self.pending: dict[Key, UsageRecord] = {}
        self.seq: dict[Key, int] = {}
        self.since: dict[Key, datetime] = {}

    def add(self, gang: str, epoch: int, node: str, size: int) -> None:
        key = (gang, epoch, node)
        if key not in self.counts:
            self.counts[key] = 0
            self.since.setdefault(key, now())
        self.counts[key] += size

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            await self.flush()

    async def flush(self) -> None:
        t = now()
        for key, size in list(self.counts.items()):
            if size and key not in self.pending:
                seq = self.seq.get(key, 0) + 1
                self.seq[key] = seq
                gang, epoch, node = key
                self.pending[key] = UsageRecord(
                    relay=self.relay,
                    boot=self.boot,
                    gang=gang,
                    epoch=epoch,
                    node=node,
                    seq=seq,
                    bytes_sent=size,
                    start_time=self.since.get(key, t),
                    end_time=t,
                )
                self.counts[key] = 0
                self.since[key] = t
        for key, record in list(self.pending.items()):
            dedup = f"{record.relay}:{record.boot}:{record.gang}:{record.epoch}:{record.node}:{record.seq}"
            try:
                await self.bus.publish(names.usage_subject(self.relay, record.gang), record, dedup)
            except Exception as error:  # kept pending; the next flush retries the same record
                USAGE_FLUSHES.labels("retry").inc()
                log.warning("usage record %s not published yet: %s", dedup, error)
                continue
            del self.pending[key]
            USAGE_FLUSHES.labels("published").inc()

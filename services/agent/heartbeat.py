"""The node's heartbeat (`nodus-health`): alive, on which boot, and what does not converge
here; a failure is said at once, not at the next beat."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from prometheus_client import Counter

from libs.bus import Bus
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.fleet import NodeHealth

log = logging.getLogger("nodus.agent")

HEARTBEATS = Counter("nodus_agent_heartbeats_total", "Heartbeats sent", ["node"])


class Heartbeat:
    def __init__(self, bus: Bus, node: str, boot_id: Callable[[], str], seconds: float) -> None:
        self.node = node
        self.seconds = seconds
        self._boot_id = boot_id
        self._health = bus.bucket(names.BUCKET_HEALTH, NodeHealth)
        self.failing: dict[str, str] = {}  # what does not converge (by its key) -> why

    async def beat(self) -> None:
        beat = NodeHealth(
            node=self.node,
            healthy=True,
            heartbeat_time=now(),
            boot_id=self._boot_id(),
            failing=[self.failing[key] for key in sorted(self.failing)],
        )
        await self._health.put(self.node, beat)
        HEARTBEATS.labels(self.node).inc()

    async def report_failing(self, key: str, line: str | None) -> None:
        """What does not converge (`line`), or that `key` converges again (None)."""
        if self.failing.get(key) == line:
            return
        if line is None:
            self.failing.pop(key, None)
        else:
            self.failing[key] = line
        try:
            await self.beat()
        except Exception as error:  # the next heartbeat carries it
            log.warning("heartbeat failed: %s", error)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.seconds)
            try:
                await self.beat()
            except Exception as error:  # the bus reconnects; keep beating
                log.warning("heartbeat failed: %s", error)

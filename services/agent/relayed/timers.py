"""The tunnel's clock: one task that sleeps until the next deadline (WireGuard's, a link's,
the links' keepalive) and fires what is due, at most every TICK; it sleeps while nothing is
due, so an idle tunnel costs nothing."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable

# The timers run at their deadlines, at most this often (timers due together fire together;
# an acknowledgement owed for what arrived waits at most this long, so acks batch).
TICK = 0.02


class Timers:
    def __init__(
        self, next_deadline: Callable[[float], float], fire: Callable[[float], None]
    ) -> None:
        self._next_deadline = next_deadline
        self._fire = fire
        self._wake_at = math.inf  # when the timers sleep until
        self._wake = asyncio.Event()  # set: a deadline earlier than _wake_at was armed
        self.wakeups = 0  # how often the timers woke (they sleep while nothing is due)

    async def run(self) -> None:
        """The first firing is TICK after the start; `rearm` wakes the loop early."""
        last = time.monotonic()
        while True:
            now = time.monotonic()
            at = max(self._next_deadline(now), last + TICK)
            if at - now > 1e-3:
                self._wake_at = at
                self._wake.clear()
                try:
                    async with asyncio.timeout(None if at == math.inf else at - now):
                        await self._wake.wait()
                except TimeoutError:
                    pass
                self.wakeups += 1
                continue
            last = now
            self._wake_at = math.inf
            self._fire(now)

    def rearm(self) -> None:
        """Something may have armed a deadline: wake the loop if it is earlier."""
        if self._next_deadline(time.monotonic()) < self._wake_at:
            self._wake.set()

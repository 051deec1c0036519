"""Per-member token buckets: a member over its share waits, so its relay connection stops being
read and TCP pushes back on the sender (G18); nothing is dropped."""

from __future__ import annotations

import asyncio
import time


class TokenBucket:
    def __init__(self, rate_bits_per_second: int, burst_bytes: int | None = None) -> None:
        self.rate = rate_bits_per_second / 8.0  # bytes per second; 0 means unlimited
        # Enough burst for a full-size message and a few ms of line rate.
        self.burst = float(burst_bytes or max(256 * 1024, int(self.rate * 0.02)))
        self.tokens = self.burst
        self.updated = time.monotonic()

    def delay_for(self, size: int, now: float) -> float:
        """Take `size` bytes; how long to wait before sending them (0 when within the share)."""
        if self.rate <= 0:
            return 0.0
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        self.tokens -= size
        return 0.0 if self.tokens >= 0 else -self.tokens / self.rate

    async def take(self, size: int) -> float:
        delay = self.delay_for(size, time.monotonic())
        if delay > 0:
            await asyncio.sleep(delay)
        return delay

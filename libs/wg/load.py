"""When the responder is under load (whitepaper 5.3), and per-source rate limits then.

Sans-I/O has no queue to measure, so load is the rate of handshake messages received: more
than `threshold` in one second puts the device under load for the next second. The caller
may also force it (`Device.force_under_load`), for instance when its own queues grow.
"""

from __future__ import annotations

from libs.wg.constants import SOURCE_BURST, SOURCE_RATE, UNDER_LOAD_HOLD

__all__ = ["LoadMonitor", "SourceRateLimiter"]


class LoadMonitor:
    __slots__ = ("_count", "_under_until", "_window_start", "threshold")

    def __init__(self, threshold: int) -> None:
        self.threshold = threshold
        self._window_start = float("-inf")
        self._count = 0
        self._under_until = float("-inf")

    def observe(self, now: float) -> None:
        """Count one handshake message received at `now`."""
        if now - self._window_start >= 1.0 or now < self._window_start:
            self._window_start = now
            self._count = 0
        self._count += 1
        if self._count > self.threshold:
            self._under_until = now + UNDER_LOAD_HOLD

    def under_load(self, now: float) -> bool:
        return now < self._under_until


class SourceRateLimiter:
    """A token bucket per source address: SOURCE_RATE per second, bursts of SOURCE_BURST."""

    __slots__ = ("_buckets", "max_sources")

    def __init__(self, max_sources: int = 4096) -> None:
        self._buckets: dict[bytes, tuple[float, float]] = {}
        self.max_sources = max_sources

    def allow(self, source: bytes, now: float) -> bool:
        tokens, last = self._buckets.get(source, (float(SOURCE_BURST), now))
        tokens = min(float(SOURCE_BURST), tokens + max(0.0, now - last) * SOURCE_RATE)
        allowed = tokens >= 1.0
        if allowed:
            tokens -= 1.0
        if source not in self._buckets and len(self._buckets) >= self.max_sources:
            self._evict(now)
        self._buckets[source] = (tokens, now)
        return allowed

    def _evict(self, now: float) -> None:
        """Forget full buckets (idle long enough to have refilled); if none, the oldest."""
        refill = SOURCE_BURST / SOURCE_RATE
        idle = [source for source, (_, last) in self._buckets.items() if now - last >= refill]
        for source in idle:
            del self._buckets[source]
        if len(self._buckets) >= self.max_sources:
            del self._buckets[next(iter(self._buckets))]

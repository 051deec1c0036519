"""TAI64N timestamps for initiations (whitepaper 5.4.2), from a wall clock the caller owns.

12 bytes, big-endian: seconds since 1970 plus 2^62 + 10 (the TAI64 label and the TAI-UTC
offset WireGuard uses), then nanoseconds. The nanoseconds are rounded down to a multiple of
2^24 (about 16.8 ms), as other implementations do, so they do not leak a precise clock.
Timestamps from one `Tai64nClock` always increase, so a responder never takes an initiation
for a replay because two were made within one rounding step.
"""

from __future__ import annotations

import struct

__all__ = ["Tai64nClock", "tai64n"]

_BASE = 0x400000000000000A
_ROUND = (1 << 24) - 1
_BILLION = 1_000_000_000
_FORMAT = struct.Struct(">QI")


def tai64n(wall_time: float) -> bytes:
    nanoseconds = int(wall_time * _BILLION)
    seconds, fraction = divmod(nanoseconds, _BILLION)
    return _FORMAT.pack(_BASE + seconds, fraction & ~_ROUND)


class Tai64nClock:
    __slots__ = ("_last",)

    def __init__(self) -> None:
        self._last = b""

    def stamp(self, wall_time: float) -> bytes:
        stamp = tai64n(wall_time)
        if stamp <= self._last:
            seconds, fraction = _FORMAT.unpack(self._last)
            fraction += _ROUND + 1
            if fraction >= _BILLION:
                seconds, fraction = seconds + 1, 0
            stamp = _FORMAT.pack(seconds, fraction)
        self._last = stamp
        return stamp

"""The sliding window of received counters (whitepaper 5.4.6, the algorithm of RFC 6479).

A ring of 64-bit blocks holds one bit per counter. Moving the window forward clears whole
blocks, so each message costs O(1) whatever the jump; one block is kept spare, so the window
is (blocks - 1) * 64 counters behind the greatest counter seen.
"""

from __future__ import annotations

from libs.wg.constants import (
    REJECT_AFTER_MESSAGES,
    REPLAY_BLOCK_BITS,
    REPLAY_RING_BLOCKS,
    REPLAY_WINDOW,
)

__all__ = ["ReplayWindow"]

_BLOCK_SHIFT = REPLAY_BLOCK_BITS.bit_length() - 1
_BIT_MASK = REPLAY_BLOCK_BITS - 1
_RING_MASK = REPLAY_RING_BLOCKS - 1
assert 1 << _BLOCK_SHIFT == REPLAY_BLOCK_BITS
assert REPLAY_RING_BLOCKS & _RING_MASK == 0


class ReplayWindow:
    __slots__ = ("_greatest", "_ring")

    def __init__(self) -> None:
        self._ring = [0] * REPLAY_RING_BLOCKS
        self._greatest = -1  # nothing seen yet

    def could_accept(self, counter: int) -> bool:
        """Whether `accept` may succeed; no state changes (checked before decrypting)."""
        if counter > self._greatest:
            return counter < REJECT_AFTER_MESSAGES
        if self._greatest - counter > REPLAY_WINDOW:
            return False
        block = (counter >> _BLOCK_SHIFT) & _RING_MASK
        return not (self._ring[block] >> (counter & _BIT_MASK)) & 1

    def accept(self, counter: int) -> bool:
        """Record an authenticated counter; False for a duplicate, too old, or past the limit."""
        ring = self._ring
        greatest = self._greatest
        if counter > greatest:
            if counter >= REJECT_AFTER_MESSAGES:
                return False
            block = counter >> _BLOCK_SHIFT
            current = greatest >> _BLOCK_SHIFT
            if block != current:
                # Entering new blocks: clear them (at most the whole ring).
                for index in range(max(current + 1, block - _RING_MASK), block + 1):
                    ring[index & _RING_MASK] = 0
            self._greatest = counter
            # Bits above the greatest counter are clear in its block: no duplicate possible.
            ring[block & _RING_MASK] |= 1 << (counter & _BIT_MASK)
            return True
        if greatest - counter > REPLAY_WINDOW:
            return False
        slot = (counter >> _BLOCK_SHIFT) & _RING_MASK
        bit = 1 << (counter & _BIT_MASK)
        old = ring[slot]
        if old & bit:
            return False
        ring[slot] = old | bit
        return True

    @property
    def greatest(self) -> int | None:
        return self._greatest if self._greatest >= 0 else None

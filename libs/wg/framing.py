"""How a payload becomes a padded plaintext, and back (whitepaper 5.4.6: zero padding to 16).

WireGuard carries IP packets and finds a packet's end from its IP header. Nodus tunnels carry
their own stream protocol, so the default framing writes the payload's length first:

    SizedFraming:  length (u16, big-endian) || payload || zeros to a multiple of 16
    IPFraming:     IP packet || zeros to a multiple of 16   (what WireGuard itself does)

An empty plaintext is a keepalive in both. `decode` works in place on the decrypted buffer
(deleting a bytearray's head and tail does not copy) and returns None when the plaintext is
not well formed.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Protocol

from libs.wg.constants import MAX_PAYLOAD, PADDING_MULTIPLE

__all__ = ["IP_PACKETS", "SIZED", "Framing", "IPFraming", "SizedFraming"]

_U16 = struct.Struct(">H")
_PAD = PADDING_MULTIPLE - 1


Buffer = bytes | bytearray | memoryview


def _copy(buffer: bytearray, at: int, pieces: Sequence[Buffer]) -> None:
    for piece in pieces:
        end = at + len(piece)
        buffer[at:end] = piece
        at = end


def _padded(length: int) -> int:
    return (length + _PAD) & ~_PAD


def _encoded(framing: Framing, payload: Buffer) -> bytearray:
    """`encode` as `encode_into` a buffer of the plaintext's own size."""
    plaintext = bytearray(framing.plaintext_size(min(len(payload), MAX_PAYLOAD + 1)))
    framing.encode_into(plaintext, (payload,))
    return plaintext


class Framing(Protocol):
    def encode(self, payload: bytes | bytearray | memoryview) -> bytearray:
        """The padded plaintext of a non-empty payload (ValueError when it cannot be sent)."""
        ...

    def encode_into(self, buffer: bytearray, pieces: Sequence[Buffer]) -> memoryview:
        """`encode` of the payload the pieces make one after the other, written at the start
        of `buffer` (at least MAX_PLAINTEXT long) and returned as a view of it: the sender
        seals it at once and reuses the buffer. The pieces are copied once, here, and never
        joined first."""
        ...

    def decode(self, plaintext: bytearray) -> bytearray | None:
        """The payload inside a non-empty padded plaintext, or None."""
        ...

    def plaintext_size(self, length: int) -> int:
        """How long the plaintext of a payload of `length` bytes is (what a relay meters)."""
        ...


class SizedFraming:
    def encode(self, payload: bytes | bytearray | memoryview) -> bytearray:
        return _encoded(self, payload)

    def encode_into(self, buffer: bytearray, pieces: Sequence[Buffer]) -> memoryview:
        length = sum(len(piece) for piece in pieces)
        if length > MAX_PAYLOAD:
            raise ValueError(f"a payload is at most {MAX_PAYLOAD} bytes, not {length}")
        end = _padded(2 + length)
        _U16.pack_into(buffer, 0, length)
        _copy(buffer, 2, pieces)
        buffer[2 + length : end] = bytes(end - 2 - length)
        return memoryview(buffer)[:end]

    def plaintext_size(self, length: int) -> int:
        return _padded(2 + length)

    def decode(self, plaintext: bytearray) -> bytearray | None:
        if len(plaintext) < 2:
            return None
        (length,) = _U16.unpack_from(plaintext)
        if 2 + length > len(plaintext):
            return None
        del plaintext[2 + length :]
        del plaintext[:2]
        return plaintext


class IPFraming:
    """Payloads are IPv4 or IPv6 packets (interoperation with other WireGuard peers)."""

    def encode(self, payload: bytes | bytearray | memoryview) -> bytearray:
        return _encoded(self, payload)

    def encode_into(self, buffer: bytearray, pieces: Sequence[Buffer]) -> memoryview:
        length = sum(len(piece) for piece in pieces)
        if length > MAX_PAYLOAD:
            raise ValueError(f"an IP packet is at most {MAX_PAYLOAD} bytes, not {length}")
        end = _padded(length)
        _copy(buffer, 0, pieces)
        buffer[length:end] = bytes(end - length)
        return memoryview(buffer)[:end]

    def plaintext_size(self, length: int) -> int:
        return _padded(length)

    def decode(self, plaintext: bytearray) -> bytearray | None:
        version = plaintext[0] >> 4
        if version == 4 and len(plaintext) >= 20:
            (length,) = _U16.unpack_from(plaintext, 2)
            if length < 20:
                return None
        elif version == 6 and len(plaintext) >= 40:
            length = 40 + _U16.unpack_from(plaintext, 4)[0]
        else:
            return None
        if length > len(plaintext):
            return None
        del plaintext[length:]
        return plaintext


SIZED = SizedFraming()
IP_PACKETS = IPFraming()

"""Wire layout of the four message types (whitepaper section 5.4), and their classification.

All integers are little-endian. Every message starts with a 32-bit type: one type byte and
three zero bytes. `message_type` is what the relay uses to check that a frame carries only
WireGuard messages: exact sizes for handshakes and cookie replies, a bounded size for
transport data.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from libs.wg.constants import (
    COOKIE_REPLY_SIZE,
    INITIATION_SIZE,
    KEEPALIVE_SIZE,
    MAX_MESSAGE_SIZE,
    RESPONSE_SIZE,
    TYPE_COOKIE_REPLY,
    TYPE_INITIATION,
    TYPE_RESPONSE,
    TYPE_TRANSPORT,
)
from libs.wg.events import DropReason

__all__ = [
    "CookieReply",
    "Initiation",
    "Response",
    "carried_bytes",
    "classify",
    "message_type",
    "pack_cookie_reply",
    "pack_initiation",
    "pack_response",
    "parse_cookie_reply",
    "parse_initiation",
    "parse_response",
]

_TYPE = struct.Struct("<I")
_INITIATION = struct.Struct("<II32s48s28s16s16s")
_RESPONSE = struct.Struct("<III32s16s16s16s")
_COOKIE_REPLY = struct.Struct("<II24s32s")
TRANSPORT_HEADER = struct.Struct("<IIQ")
"""type, receiver index, counter."""

assert _INITIATION.size == INITIATION_SIZE
assert _RESPONSE.size == RESPONSE_SIZE
assert _COOKIE_REPLY.size == COOKIE_REPLY_SIZE

_EXACT_SIZES = {
    TYPE_INITIATION: INITIATION_SIZE,
    TYPE_RESPONSE: RESPONSE_SIZE,
    TYPE_COOKIE_REPLY: COOKIE_REPLY_SIZE,
}


def carried_bytes(data: bytes | bytearray | memoryview) -> int:
    """What a message carries for the programs at its ends: a transport message's plaintext
    (its length less WireGuard's 16-byte header and 16-byte tag), nothing for a keepalive or
    a handshake. The relays bill this (G17), not WireGuard's own bytes."""
    if len(data) <= KEEPALIVE_SIZE or _TYPE.unpack_from(data)[0] != TYPE_TRANSPORT:
        return 0
    return len(data) - KEEPALIVE_SIZE


def classify(data: bytes | bytearray | memoryview) -> int | DropReason:
    """The message type, or why the bytes are not a WireGuard message."""
    if len(data) < 4:
        return DropReason.BAD_SIZE
    kind: int = _TYPE.unpack_from(data)[0]
    if kind == TYPE_TRANSPORT:
        if KEEPALIVE_SIZE <= len(data) <= MAX_MESSAGE_SIZE:
            return kind
        return DropReason.BAD_SIZE
    size = _EXACT_SIZES.get(kind)
    if size is None:
        return DropReason.UNKNOWN_TYPE
    if len(data) != size:
        return DropReason.BAD_SIZE
    return kind


def message_type(data: bytes | bytearray | memoryview) -> int | None:
    """1 initiation, 2 response, 3 cookie reply, 4 transport data; None when malformed."""
    kind = classify(data)
    return kind if isinstance(kind, int) else None


class Initiation(NamedTuple):
    sender: int
    ephemeral: bytes
    static: bytes
    timestamp: bytes
    mac1: bytes
    mac2: bytes


class Response(NamedTuple):
    sender: int
    receiver: int
    ephemeral: bytes
    empty: bytes
    mac1: bytes
    mac2: bytes


class CookieReply(NamedTuple):
    receiver: int
    nonce: bytes
    cookie: bytes


def parse_initiation(data: bytes) -> Initiation:
    _, *fields = _INITIATION.unpack(data)
    return Initiation(*fields)


def parse_response(data: bytes) -> Response:
    _, *fields = _RESPONSE.unpack(data)
    return Response(*fields)


def parse_cookie_reply(data: bytes) -> CookieReply:
    _, *fields = _COOKIE_REPLY.unpack(data)
    return CookieReply(*fields)


def pack_initiation(sender: int, ephemeral: bytes, static: bytes, timestamp: bytes) -> bytearray:
    """The initiation with zero macs; cookie.py fills them in."""
    out = bytearray(INITIATION_SIZE)
    _INITIATION.pack_into(
        out, 0, TYPE_INITIATION, sender, ephemeral, static, timestamp, bytes(16), bytes(16)
    )
    return out


def pack_response(sender: int, receiver: int, ephemeral: bytes, empty: bytes) -> bytearray:
    """The response with zero macs; cookie.py fills them in."""
    out = bytearray(RESPONSE_SIZE)
    _RESPONSE.pack_into(
        out, 0, TYPE_RESPONSE, sender, receiver, ephemeral, empty, bytes(16), bytes(16)
    )
    return out


def pack_cookie_reply(receiver: int, nonce: bytes, cookie: bytes) -> bytes:
    return _COOKIE_REPLY.pack(TYPE_COOKIE_REPLY, receiver, nonce, cookie)

"""What the Device hands back to the code around it: messages to send, payloads, and drops.

Events are plain slotted dataclasses (not frozen: that costs more than the rest of an event
on the transport path); treat them as read-only.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = [
    "Delivered",
    "DropReason",
    "Dropped",
    "Event",
    "HandshakeCompleted",
    "HandshakeFailed",
    "Outgoing",
]


class DropReason(StrEnum):
    """Why an input was dropped; `Device.drops` counts them."""

    BAD_SIZE = "bad message size"
    UNKNOWN_TYPE = "unknown message type"
    BAD_MAC1 = "bad mac1"
    COOKIE_SENT = "under load: answered with a cookie"
    RATE_LIMITED = "under load: rate limited"
    HANDSHAKE_AUTH = "handshake authentication failed"
    UNKNOWN_PEER = "unknown peer"
    STALE_TIMESTAMP = "replayed initiation timestamp"
    INITIATION_FLOOD = "initiation flood"
    UNKNOWN_INDEX = "unknown receiver index"
    BAD_COOKIE = "bad cookie reply"
    SESSION_EXPIRED = "session expired"
    TRANSPORT_AUTH = "transport authentication failed"
    REPLAYED = "replayed counter"
    BAD_PAYLOAD = "bad payload"
    QUEUE_FULL = "send queue full"
    HANDSHAKE_FAILED = "handshake attempts exhausted"


@dataclass(slots=True)
class Outgoing:
    """Bytes to send. `peer` is None for a cookie reply to an unauthenticated sender; then
    `reply_to` is the `source` the message arrived with, and the reply goes back there."""

    peer: bytes | None
    data: bytes | bytearray
    reply_to: bytes | None = None


@dataclass(slots=True)
class Delivered:
    """An authenticated payload from `peer` (never a keepalive)."""

    peer: bytes
    payload: bytes | bytearray


@dataclass(slots=True)
class HandshakeCompleted:
    """A new session with `peer` is in use (the initiator: response received; the
    responder: the initiator's first transport message received)."""

    peer: bytes
    initiator: bool


@dataclass(slots=True)
class HandshakeFailed:
    """No response for Rekey-Attempt-Time: the handshake stopped, queued payloads dropped."""

    peer: bytes
    dropped_payloads: int


@dataclass(slots=True)
class Dropped:
    """An input that was not accepted (malformed, unauthenticated, replayed, expired, ...)."""

    reason: DropReason
    peer: bytes | None = None


Event = Outgoing | Delivered | HandshakeCompleted | HandshakeFailed | Dropped

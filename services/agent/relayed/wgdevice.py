"""The tunnel's view of WireGuard: messages addressed by peer key, payloads delivered by peer.

A thin adapter over libs.wg.Device: on the Relayed path every message travels to a peer key
through a relay, so a message's "source" is the sender's key and a cookie reply goes back to
that key."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import Counter

from libs.wg import Delivered, Device, Dropped, HandshakeCompleted, HandshakeFailed, Outgoing
from libs.wg import Event as WgEvent

Wire = list[tuple[bytes, bytes | bytearray]]  # (destination key, WireGuard message)

DROPS = Counter("nodus_agent_wireguard_drops_total", "WireGuard messages not accepted", ["reason"])
HANDSHAKES = Counter(
    "nodus_agent_wireguard_handshakes_total", "Sessions established or failed", ["outcome"]
)


class WgDevice:
    def __init__(self, private_key: bytes) -> None:
        self._device = Device(private_key)

    @property
    def private_key(self) -> bytes:
        return self._device.private_key

    @property
    def public_key(self) -> bytes:
        return self._device.public_key

    def add_peer(self, key: bytes) -> None:
        self._device.add_peer(key)

    def plaintext_size(self, payload: int) -> int:
        """What a relay meters of a payload of this many bytes (its padded plaintext)."""
        return self._device.framing.plaintext_size(payload)

    def send_pieces(self, peer: bytes, pieces: Sequence[bytes | memoryview], now: float) -> Wire:
        """`send` of the payload the pieces make, copied once into the plaintext."""
        return _wire(self._device.send_pieces(peer, pieces, now))

    def receive(
        self, message: bytes | bytearray | memoryview, now: float, source: bytes
    ) -> tuple[Wire, list[tuple[bytes, bytes | bytearray]]]:
        """Replies to send and payloads delivered (each its own new buffer, not copied again)."""
        events = self._device.receive(message, now, source)
        delivered = [(e.peer, e.payload) for e in events if isinstance(e, Delivered)]
        return _wire(events), delivered

    def tick(self, now: float) -> Wire:
        return _wire(self._device.tick(now))

    def next_deadline(self) -> float | None:
        """When `tick` next has something to fire (None: no timer armed)."""
        return self._device.next_deadline()


def _wire(events: list[WgEvent] | list[Outgoing] | list[Outgoing | HandshakeFailed]) -> Wire:
    out: Wire = []
    for event in events:
        if isinstance(event, Outgoing):
            destination = event.peer if event.peer is not None else event.reply_to
            if destination is not None:
                out.append((destination, event.data))  # sealed for us alone: not copied
        elif isinstance(event, Dropped):
            DROPS.labels(event.reason.value).inc()
        elif isinstance(event, HandshakeCompleted):
            HANDSHAKES.labels("completed").inc()
        elif isinstance(event, HandshakeFailed):
            HANDSHAKES.labels("failed").inc()
    return out

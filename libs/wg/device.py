"""The Device: one static identity, its peers, and the three calls the I/O code makes.

    device = Device(private_key)
    device.add_peer(peer_public_key, preshared_key=None)
    device.send(peer_public_key, payload, now)   -> [Outgoing]          (queues; handshakes)
    device.receive(message, now, source=b"")     -> [Outgoing | Delivered | HandshakeCompleted
                                                     | Dropped]
    device.tick(now)                             -> [Outgoing | HandshakeFailed]
    device.next_deadline()                       -> when to call tick next (or None)

`now` is the caller's monotonic clock in seconds; it drives every timer. The only other clock
is `wall_clock` (default `time.time`), read once per initiation for its TAI64N timestamp, which
a responder requires to grow across restarts of this process.

Payloads are framed by `framing` (framing.py): SIZED (the default: any bytes, up to 65,535)
between Nodus peers, IP_PACKETS to talk to another WireGuard implementation. A Device is not
thread-safe: one owner (an event loop) makes every call.
"""

from __future__ import annotations

import random
import secrets
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from libs.wg import receive as receive_path
from libs.wg import send as send_path
from libs.wg import timers
from libs.wg.constants import (
    DEFAULT_LOAD_THRESHOLD,
    DEFAULT_QUEUE_LIMIT,
    MAX_PLAINTEXT,
    REKEY_TIMEOUT_JITTER,
)
from libs.wg.cookie import CookieChecker
from libs.wg.events import Dropped, DropReason, Event, Outgoing
from libs.wg.framing import SIZED, Framing
from libs.wg.handshake import Identity, PeerKeys
from libs.wg.keys import check_key
from libs.wg.load import LoadMonitor, SourceRateLimiter
from libs.wg.peer import Peer
from libs.wg.session import Session
from libs.wg.tai64n import Tai64nClock

__all__ = ["Device", "PeerStatus", "UnknownPeer"]


class UnknownPeer(KeyError):
    """`send` or another call named a public key that is not a peer of this device."""


@dataclass(frozen=True, slots=True)
class PeerStatus:
    public_key: bytes
    has_session: bool  # a current session that may send now
    last_handshake: float | None  # `now` of the last completed handshake
    sent_bytes: int  # transport messages, headers included
    received_bytes: int
    queued: int  # payloads waiting for a session


class Device:
    def __init__(
        self,
        private_key: bytes,
        *,
        wall_clock: Callable[[], float] | None = None,
        framing: Framing = SIZED,
        queue_limit: int = DEFAULT_QUEUE_LIMIT,
        load_threshold: int = DEFAULT_LOAD_THRESHOLD,
        rng: random.Random | None = None,
    ) -> None:
        check_key(private_key, "private key")
        self.private_key = private_key
        self.identity = Identity(private_key)
        self.public_key = self.identity.public
        self.framing = framing
        self.queue_limit = queue_limit
        self.checker = CookieChecker(self.identity.mac1_key, self.identity.cookie_key)
        self.load = LoadMonitor(load_threshold)
        self.rate_limiter = SourceRateLimiter()
        self.force_under_load = False
        self.peers: dict[bytes, Peer] = {}
        self.drops: Counter[DropReason] = Counter()
        # Local (receiver) index -> the peer, and its session (None: our initiation in flight).
        self.index: dict[int, tuple[Peer, Session | None]] = {}
        self._wall_clock = wall_clock if wall_clock is not None else time.time
        self._tai64n = Tai64nClock()
        self._rng = rng if rng is not None else random.Random(secrets.randbits(64))
        self._plaintext = bytearray(MAX_PLAINTEXT)  # each payload is framed here, then sealed

    # The calls the I/O code makes.

    def add_peer(
        self,
        public_key: bytes,
        preshared_key: bytes | None = None,
        *,
        persistent_keepalive: float | None = None,
    ) -> None:
        """Add (or replace) a peer; ValueError for a malformed or unusable key."""
        check_key(public_key, "public key")
        if preshared_key is not None:
            check_key(preshared_key, "preshared key")
        if public_key == self.public_key:
            raise ValueError("a device cannot be its own peer")
        if public_key in self.peers:
            self.remove_peer(public_key)
        keys = PeerKeys(self.identity, public_key, preshared_key)
        self.peers[public_key] = Peer(keys, persistent_keepalive)

    def remove_peer(self, public_key: bytes) -> None:
        peer = self._peer(public_key)
        self.retire(peer.clear_sessions())
        self.drop_pending(peer)
        del self.peers[public_key]

    def send(
        self, peer_public_key: bytes, payload: bytes | bytearray | memoryview, now: float
    ) -> list[Outgoing]:
        """Encrypt `payload` for the peer, or queue it and start a handshake.

        An empty payload sends a keepalive. ValueError when the payload is too large for the
        framing, UnknownPeer for a key that is not a peer."""
        return self.send_pieces(peer_public_key, (payload,), now)

    def send_pieces(
        self, peer_public_key: bytes, pieces: Sequence[bytes | bytearray | memoryview], now: float
    ) -> list[Outgoing]:
        """`send` of the payload the pieces make one after the other (copied once, into the
        plaintext: a sender need not join them first)."""
        peer = self._peer(peer_public_key)
        if not any(pieces):
            return send_path.keepalive(self, peer, now)
        plaintext = self.framing.encode_into(self._plaintext, pieces)
        return send_path.send(self, peer, plaintext, now)

    def receive(
        self, message: bytes | bytearray | memoryview, now: float, source: bytes = b""
    ) -> list[Event]:
        """Process one message from the network. `source` names where it came from (for
        example the packed address and port): cookies are bound to it under load, and a
        cookie reply goes back to it. Never raises for any input."""
        return receive_path.receive(self, message, now, source)

    def tick(self, now: float) -> list[Event]:
        """Fire the timers that are due."""
        events: list[Event] = []
        for peer in list(self.peers.values()):
            deadline = timers.next_deadline(peer)
            if deadline is not None and deadline <= now:
                events.extend(timers.expire(self, peer, now))
        return events

    def next_deadline(self) -> float | None:
        deadlines = [d for p in self.peers.values() if (d := timers.next_deadline(p)) is not None]
        return min(deadlines) if deadlines else None

    def initiate_handshake(self, peer_public_key: bytes, now: float) -> list[Outgoing]:
        """Start a handshake now (at most one per Rekey-Timeout)."""
        return send_path.initiate(self, self._peer(peer_public_key), now)

    def has_session(self, peer_public_key: bytes, now: float) -> bool:
        current = self._peer(peer_public_key).current
        return current is not None and current.can_send(now)

    def peer_status(self, peer_public_key: bytes, now: float) -> PeerStatus:
        peer = self._peer(peer_public_key)
        return PeerStatus(
            public_key=peer.public_key,
            has_session=self.has_session(peer_public_key, now),
            last_handshake=peer.last_handshake,
            sent_bytes=peer.sent_bytes,
            received_bytes=peer.received_bytes,
            queued=len(peer.queue),
        )

    def under_load(self, now: float) -> bool:
        return self.force_under_load or self.load.under_load(now)

    # Shared by the send, receive and timer paths.

    def drop(self, reason: DropReason, peer: Peer | None = None) -> list[Event]:
        self.drops[reason] += 1
        return [Dropped(reason, peer.public_key if peer is not None else None)]

    def count_drop(self, reason: DropReason, count: int = 1) -> None:
        self.drops[reason] += count

    def flush_queue(self, peer: Peer, reason: DropReason) -> int:
        dropped = len(peer.queue)
        if dropped:
            peer.queue.clear()
            self.count_drop(reason, dropped)
        return dropped

    def timestamp(self) -> bytes:
        return self._tai64n.stamp(self._wall_clock())

    def jitter(self) -> float:
        return self._rng.uniform(0.0, REKEY_TIMEOUT_JITTER)

    def reserve_index(self, peer: Peer) -> int:
        while True:
            index = self._rng.getrandbits(32)
            if index not in self.index:
                self.index[index] = (peer, None)
                return index

    def release_index(self, index: int) -> None:
        self.index.pop(index, None)

    def bind_index(self, index: int, peer: Peer, session: Session) -> None:
        self.index[index] = (peer, session)

    def retire(self, sessions: list[Session]) -> None:
        for session in sessions:
            entry = self.index.get(session.local_index)
            if entry is not None and entry[1] is session:
                del self.index[session.local_index]

    def drop_pending(self, peer: Peer) -> None:
        if peer.pending is not None:
            entry = self.index.get(peer.pending.local_index)
            if entry is not None and entry[1] is None:
                del self.index[peer.pending.local_index]
            peer.pending = None

    def pending_peer(self, index: int) -> Peer | None:
        """The peer whose initiation has this sender index, still awaiting its response."""
        entry = self.index.get(index)
        if entry is None or entry[1] is not None:
            return None
        peer = entry[0]
        if peer.pending is None or peer.pending.local_index != index:
            return None
        return peer

    def index_peer(self, index: int) -> Peer | None:
        entry = self.index.get(index)
        return entry[0] if entry is not None else None

    def _peer(self, public_key: bytes) -> Peer:
        peer = self.peers.get(public_key)
        if peer is None:
            raise UnknownPeer(public_key.hex())
        return peer

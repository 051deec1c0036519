"""What the device keeps per peer: keys, sessions, handshake state, queue, timer deadlines."""

from __future__ import annotations

from collections import deque

from libs.wg.constants import TIMESTAMP_SIZE
from libs.wg.cookie import CookieJar
from libs.wg.handshake import PeerKeys, PendingInitiation
from libs.wg.session import Session

__all__ = ["Peer"]

_NEVER = float("-inf")


class Peer:
    def __init__(self, keys: PeerKeys, persistent_keepalive: float | None) -> None:
        self.keys = keys
        self.public_key = keys.public
        self.cookies = CookieJar(keys.mac1_key, keys.cookie_key)
        self.persistent_keepalive = persistent_keepalive

        # Sessions (section 6.1): `current` sends; `next` is a responder's session that the
        # initiator has not used yet; `previous` still receives what was in flight.
        self.current: Session | None = None
        self.previous: Session | None = None
        self.next: Session | None = None
        self.pending: PendingInitiation | None = None  # our initiation awaiting a response

        self.greatest_timestamp = bytes(TIMESTAMP_SIZE)  # of initiations received
        self.last_initiation_received = _NEVER
        self.last_initiation_sent = _NEVER
        self.attempts_started: float | None = None  # first initiation of the current series
        self.rekey_on_receive_sent = False
        self.last_handshake: float | None = None

        self.queue: deque[bytearray] = deque()  # padded plaintexts waiting for a session

        # Timer deadlines (timers.py); None when not armed.
        self.retransmit_at: float | None = None
        self.keepalive_at: float | None = None
        self.keepalive_again = False
        self.new_handshake_at: float | None = None
        self.zero_keys_at: float | None = None
        self.persistent_keepalive_at: float | None = None

        self.sent_bytes = 0
        self.received_bytes = 0

    def sessions(self) -> list[Session]:
        return [s for s in (self.current, self.previous, self.next) if s is not None]

    def install_initiator_session(self, session: Session) -> list[Session]:
        """The initiator uses a new session at once; returns the sessions it retires."""
        retired = [s for s in (self.previous,) if s is not None]
        if self.next is not None:
            # A responder session the peer never confirmed stays only to receive.
            if self.current is not None:
                retired.append(self.current)
            self.previous, self.next = self.next, None
        else:
            self.previous = self.current
        self.current = session
        return retired

    def install_responder_session(self, session: Session) -> list[Session]:
        """The responder keeps a new session as `next` until the initiator uses it."""
        retired = [s for s in (self.next, self.previous) if s is not None]
        self.next = session
        self.previous = None
        return retired

    def confirm_next(self) -> list[Session]:
        """The initiator used `next`: it becomes `current`; returns the retired session."""
        retired = [s for s in (self.previous,) if s is not None]
        self.previous, self.current, self.next = self.current, self.next, None
        return retired

    def clear_sessions(self) -> list[Session]:
        retired = self.sessions()
        self.current = self.previous = self.next = None
        return retired

"""The opening of every relay connection, sans-I/O: one state machine per side, shared by the
member's client, the relay's mesh links and the relay's listener.

    dialer (member or relay)                 relay (acceptor)
                         <-- Challenge(relay key, fresh nonce)
    Hello | MeshHello    -->
                         <-- Welcome | ErrorFrame
    ... session frames both ways ...

Relays of one host may share a port (SO_REUSEPORT), so a member that dialled it may be
challenged by a sibling of its relay. It knows its relay's key from the relay's record: told
another key, it answers Route(its relay's name) once; the sibling hands the connection to that
relay, which challenges it afresh (services/relay/sharing.py).

Frames are fed one at a time, in the order they arrived. Whatever follows the last handshake
frame in the same TCP read (a relay may send Welcome and the first forwarded message in one
segment) is the session's: `take_session_frames` hands it over, in order, so nothing is lost
and nothing is refused for arriving early.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from enum import Enum

from libs.relayproto.frames import (
    Challenge,
    ErrorFrame,
    Frame,
    FrameError,
    Hello,
    MeshHello,
    Route,
    Welcome,
)

Answer = Callable[[Challenge], Hello | MeshHello]


class HandshakeRefused(Exception):
    """The relay said no (ErrorFrame): not a member, a bad proof, a wrong mesh key."""

    def __init__(self, refusal: ErrorFrame) -> None:
        super().__init__(f"{refusal.code}: {refusal.message}")
        self.code = refusal.code
        self.message = refusal.message


class State(Enum):
    AWAITING_CHALLENGE = "awaiting-challenge"
    AWAITING_HELLO = "awaiting-hello"
    AWAITING_WELCOME = "awaiting-welcome"
    ESTABLISHED = "established"


class _Handshake:
    def __init__(self, state: State) -> None:
        self.state = state
        self._session: list[Frame] = []

    @property
    def established(self) -> bool:
        return self.state is State.ESTABLISHED

    def take_session_frames(self) -> list[Frame]:
        """Frames that arrived after the handshake ended, in arrival order."""
        frames, self._session = self._session, []
        return frames


class DialerHandshake(_Handshake):
    """The side that connects: answers the relay's challenge with `answer(challenge)` (a
    member's Hello or a relay's MeshHello), then waits for Welcome. `expect`: the name and key
    of the relay meant, when it may share its port: a challenge with another key is answered
    once with Route(name), and the relay handed the connection challenges again."""

    def __init__(self, answer: Answer, expect: tuple[str, bytes] | None = None) -> None:
        super().__init__(State.AWAITING_CHALLENGE)
        self._answer = answer
        self._expect = expect
        self.routed = False  # a Route was sent: the second challenge is answered, whatever key
        self.welcome: Welcome | None = None

    def receive(self, frame: Frame) -> Frame | None:
        """One frame from the relay; returns the frame to send back, if any."""
        if self.state is State.ESTABLISHED:
            self._session.append(frame)
            return None
        if self.state is State.AWAITING_CHALLENGE:
            if isinstance(frame, ErrorFrame):
                raise HandshakeRefused(frame)  # a sibling that could not hand us on
            if not isinstance(frame, Challenge):
                raise FrameError(f"expected a challenge, got {type(frame).__name__}")
            if self._expect is not None and not self.routed:
                name, key = self._expect
                if frame.relay_key != key:
                    self.routed = True
                    return Route(name)
            self.state = State.AWAITING_WELCOME
            return self._answer(frame)
        if isinstance(frame, ErrorFrame):
            raise HandshakeRefused(frame)
        if not isinstance(frame, Welcome):
            raise FrameError(f"expected welcome, got {type(frame).__name__}")
        self.welcome = frame
        self.state = State.ESTABLISHED
        return None


class AcceptorHandshake(_Handshake):
    """The relay's side: a challenge with a fresh nonce goes out first; the dialer's Hello or
    MeshHello comes back, or a member's Route (in `.route`) when it meant another relay of a
    shared port; `routed`: this connection was handed on already, so a second Route is
    malformed. The relay then checks the proof and sends Welcome or ErrorFrame itself
    (checking needs its membership view, which is not protocol)."""

    def __init__(self, relay_key: bytes, nonce: bytes | None = None, routed: bool = False) -> None:
        super().__init__(State.AWAITING_HELLO)
        self.challenge = Challenge(relay_key, nonce or secrets.token_bytes(32))
        self.hello: Hello | MeshHello | None = None
        self.route: str | None = None
        self._routed = routed

    @property
    def nonce(self) -> bytes:
        return self.challenge.nonce

    def receive(self, frame: Frame) -> None:
        if self.state is State.ESTABLISHED:
            self._session.append(frame)
            return
        if isinstance(frame, Route) and not self._routed:
            self.route = frame.relay
        elif isinstance(frame, Hello | MeshHello):
            self.hello = frame
        else:
            raise FrameError(f"expected hello, got {type(frame).__name__}")
        self.state = State.ESTABLISHED

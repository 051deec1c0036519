"""libs.wg timers (whitepaper section 6), driven by `tick(now)` on a simulated clock."""

from __future__ import annotations

import itertools

from libs.wg import (
    Delivered,
    Device,
    DropReason,
    HandshakeCompleted,
    HandshakeFailed,
    Outgoing,
    generate_private_key,
    message_type,
)
from libs.wg.constants import (
    KEEPALIVE_SIZE,
    KEEPALIVE_TIMEOUT,
    REJECT_AFTER_MESSAGES,
    REJECT_AFTER_TIME,
    REKEY_AFTER_MESSAGES,
    REKEY_AFTER_TIME,
    REKEY_ATTEMPT_TIME,
    REKEY_TIMEOUT,
    REKEY_TIMEOUT_JITTER,
    ZERO_KEYS_AFTER,
)
from libs.wg.loopback import Loopback


def _established() -> Loopback:
    """A initiated at t=0 and sent b"hello"; B's passive keepalive has answered it."""
    loop = Loopback.create()
    loop.send(loop.a, b"hello")
    loop.advance(KEEPALIVE_TIMEOUT + 0.5)
    assert [bytes(d.payload) for d in loop.take(loop.b, Delivered)] == [b"hello"]
    loop.take(loop.a, HandshakeCompleted)
    loop.take(loop.b, HandshakeCompleted)
    return loop


def _types(messages: list[bytes | bytearray]) -> list[int | None]:
    return [message_type(m) for m in messages]


def _payloads(loop: Loopback, device: Device) -> list[bytes]:
    return [bytes(d.payload) for d in loop.take(device, Delivered)]


def test_initiation_is_retransmitted_with_jitter_then_abandoned_after_rekey_attempt_time() -> None:
    loop = Loopback.create()
    loop.connected = False
    loop.send(loop.a, b"nobody hears")
    sent_at = [0.0]
    while loop.now < REKEY_ATTEMPT_TIME + 2 * REKEY_TIMEOUT:
        before = len(loop.wire)
        loop.advance(0.01, step=0.01)
        if len(loop.wire) > before:
            sent_at.append(loop.now)
    assert set(_types(loop.held())) == {1}
    gaps = [b - a for a, b in itertools.pairwise(sent_at)]
    assert all(REKEY_TIMEOUT <= g <= REKEY_TIMEOUT + REKEY_TIMEOUT_JITTER + 0.02 for g in gaps)
    assert sent_at[-1] < REKEY_ATTEMPT_TIME + REKEY_TIMEOUT + REKEY_TIMEOUT_JITTER
    assert len({bytes(m[8:40]) for m in loop.held()}) == len(sent_at)  # fresh ephemerals
    assert loop.take(loop.a, HandshakeFailed) == [HandshakeFailed(loop.b.public_key, 1)]
    assert loop.a.drops == {DropReason.HANDSHAKE_FAILED: 1}

    loop.wire.clear()
    loop.send(loop.a, b"later")  # a new series starts
    assert _types(loop.held()) == [1]


def test_initiations_are_sent_at_most_once_per_rekey_timeout() -> None:
    loop = Loopback.create()
    loop.connected = False
    for i in range(10):
        loop.send(loop.a, b"%d" % i)
    loop.now = REKEY_TIMEOUT - 0.1
    loop.route(loop.a, loop.a.initiate_handshake(loop.b.public_key, loop.now))
    assert _types(loop.held()) == [1]
    assert loop.a.peer_status(loop.b.public_key, loop.now).queued == 10


def test_queue_is_bounded_and_keeps_the_newest() -> None:
    a, b = Device(generate_private_key(), queue_limit=4), Device(generate_private_key())
    a.add_peer(b.public_key)
    b.add_peer(a.public_key)
    loop = Loopback(a, b)
    loop.connected = False
    for i in range(6):
        loop.send(a, b"%d" % i)
    assert a.drops == {DropReason.QUEUE_FULL: 2}
    loop.connected = True
    for receiver, message in loop.wire:
        loop.deliver(receiver, message)
    assert _payloads(loop, b) == [b"2", b"3", b"4", b"5"]


def test_initiator_rekeys_after_rekey_after_time_and_old_sessions_still_receive() -> None:
    loop = _established()
    loop.advance(REKEY_AFTER_TIME - loop.now - 1, step=1.0)
    loop.connected = False
    loop.send(loop.a, b"before")
    assert _types(loop.held()) == [4]  # not yet: the session is 119 s old
    in_flight = loop.held()[0]
    loop.wire.clear()
    loop.now = REKEY_AFTER_TIME + 1
    loop.send(loop.a, b"after")
    assert _types(loop.held()) == [4, 1]  # the data on the old session, and an initiation
    loop.connected = True
    for receiver, message in loop.wire:
        loop.deliver(receiver, message)
    loop.wire.clear()
    assert loop.take(loop.a, HandshakeCompleted) == [HandshakeCompleted(loop.b.public_key, True)]
    loop.send(loop.a, b"new session")
    loop.deliver(loop.b, in_flight)  # sealed on the session before: still accepted once
    assert _payloads(loop, loop.b) == [b"after", b"new session", b"before"]
    session = loop.a.peers[loop.b.public_key].current
    assert session is not None and session.created == loop.now


def test_responder_does_not_rekey_on_time() -> None:
    loop = _established()
    loop.advance(REKEY_AFTER_TIME + 1 - loop.now, step=1.0)
    loop.connected = False
    loop.send(loop.b, b"from the responder")
    assert _types(loop.held()) == [4]


def test_initiator_rekeys_when_it_receives_on_an_old_session() -> None:
    loop = _established()
    loop.advance(REJECT_AFTER_TIME - KEEPALIVE_TIMEOUT - REKEY_TIMEOUT - loop.now - 1, step=1.0)
    loop.connected = False
    loop.send(loop.b, b"164 s")
    [message] = loop.held()
    loop.wire.clear()
    loop.deliver(loop.a, message)
    assert loop.held() == []  # not yet
    loop.now += 2
    initiations = []
    for text in (b"166 s", b"again"):
        loop.send(loop.b, text)
        [message] = loop.held(loop.a)
        loop.wire.clear()
        loop.deliver(loop.a, message)
        initiations += [m for m in loop.held(loop.b) if message_type(m) == 1]
    assert len(initiations) == 1  # once, on the first message past 165 s


def test_sessions_are_rejected_after_reject_after_time() -> None:
    loop = _established()
    loop.connected = False
    loop.now = REJECT_AFTER_TIME - 1
    loop.send(loop.a, b"late")
    data, initiation = loop.held()
    assert _types([data, initiation]) == [4, 1]
    loop.wire.clear()
    loop.now = REJECT_AFTER_TIME + 0.5
    loop.deliver(loop.b, data)
    assert loop.b.drops == {DropReason.SESSION_EXPIRED: 1}
    assert not loop.a.has_session(loop.b.public_key, loop.now)
    loop.send(loop.a, b"queued")
    assert loop.held() == []  # no session to send on; the initiation was sent 1.5 s ago
    loop.connected = True
    loop.deliver(loop.b, initiation)
    assert _payloads(loop, loop.b) == [b"queued"]


def test_sessions_are_rejected_after_reject_after_messages_and_rekeyed_before() -> None:
    loop = _established()
    session = loop.a.peers[loop.b.public_key].current
    assert session is not None
    session.send_counter = REKEY_AFTER_MESSAGES + 1
    loop.connected = False
    loop.send(loop.a, b"rekey now")
    assert _types(loop.held()) == [4, 1]
    loop.wire.clear()
    loop.now += REKEY_TIMEOUT + 1
    session.send_counter = REJECT_AFTER_MESSAGES
    loop.send(loop.a, b"must wait")
    assert _types(loop.held()) == [1]  # nothing may be sealed with this session any more
    loop.connected = True
    for receiver, message in loop.wire:
        loop.deliver(receiver, message)
    assert _payloads(loop, loop.b) == [b"must wait"]


def test_passive_keepalive_after_keepalive_timeout_unless_data_was_sent() -> None:
    loop = _established()
    loop.connected = False
    loop.send(loop.a, b"data")
    loop.wire.clear()
    loop.connected = True
    loop.deliver(loop.b, bytes(loop.a.send(loop.b.public_key, b"more", loop.now)[0].data))
    loop.connected = False
    start = loop.now
    loop.advance(KEEPALIVE_TIMEOUT - 0.1)
    assert loop.held(loop.a) == []
    loop.advance(0.2)
    [keepalive] = loop.held(loop.a)
    assert len(keepalive) == KEEPALIVE_SIZE

    loop.wire.clear()
    loop.connected = True
    loop.send(loop.a, b"ping")
    loop.advance(KEEPALIVE_TIMEOUT / 2)
    loop.send(loop.b, b"pong")  # B answered with data: no keepalive needed
    loop.connected = False
    loop.advance(KEEPALIVE_TIMEOUT / 2 + 0.2)
    assert [m for m in loop.held(loop.a) if len(m) == KEEPALIVE_SIZE] == []
    assert loop.now > start


def test_new_handshake_when_sent_data_gets_no_answer() -> None:
    loop = _established()
    loop.connected = False
    loop.send(loop.a, b"anyone?")
    loop.wire.clear()
    loop.advance(KEEPALIVE_TIMEOUT + REKEY_TIMEOUT - 0.05)
    assert loop.held() == []
    loop.advance(REKEY_TIMEOUT_JITTER + 0.1)
    assert _types(loop.held()) == [1]


def test_keys_are_erased_after_three_reject_after_times() -> None:
    loop = _established()
    loop.advance(ZERO_KEYS_AFTER + 1 - loop.now, step=1.0)
    for device in (loop.a, loop.b):
        peer = device.peers[loop.peer_of(device).public_key]
        assert peer.sessions() == [] and peer.pending is None
        assert device.next_deadline() is None
    loop.send(loop.a, b"new start")
    assert _payloads(loop, loop.b) == [b"new start"]


def test_persistent_keepalive() -> None:
    a, b = Device(generate_private_key()), Device(generate_private_key())
    a.add_peer(b.public_key, persistent_keepalive=25)
    b.add_peer(a.public_key)
    loop = Loopback(a, b)
    loop.route(a, a.initiate_handshake(b.public_key, 0.0))
    loop.connected = False
    loop.advance(101, step=0.5)
    keepalives = [m for m in loop.held(b) if len(m) == KEEPALIVE_SIZE]
    assert len(keepalives) == 4  # at 25, 50, 75, 100 s


def test_next_deadline_says_when_to_tick() -> None:
    loop = Loopback.create()
    assert loop.a.next_deadline() is None
    loop.connected = False
    [initiation] = loop.a.send(loop.b.public_key, b"x", 10.0)
    assert isinstance(initiation, Outgoing)
    deadline = loop.a.next_deadline()
    assert deadline is not None
    assert 10.0 + REKEY_TIMEOUT <= deadline <= 10.0 + REKEY_TIMEOUT + REKEY_TIMEOUT_JITTER
    assert loop.a.tick(deadline - 0.001) == []
    [retry] = loop.a.tick(deadline)
    assert isinstance(retry, Outgoing) and message_type(retry.data) == 1

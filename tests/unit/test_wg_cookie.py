"""libs.wg under load: cookie replies, mac2, per-source rate limits (whitepaper 5.3, 5.4.7)."""

from __future__ import annotations

import os

from libs.wg import (
    Delivered,
    Device,
    Dropped,
    DropReason,
    HandshakeCompleted,
    Outgoing,
    generate_private_key,
    message_type,
)
from libs.wg.constants import COOKIE_REFRESH_TIME, COOKIE_REPLY_SIZE, SOURCE_BURST
from libs.wg.loopback import Loopback
from libs.wg.messages import pack_cookie_reply


def _initiation(loop: Loopback) -> bytes:
    """A's next initiation, captured off the wire."""
    loop.connected = False
    loop.wire.clear()
    loop.route(loop.a, loop.a.initiate_handshake(loop.b.public_key, loop.now))
    [(_, message)] = loop.wire
    loop.wire.clear()
    loop.connected = True
    return bytes(message)


def test_responder_under_load_answers_with_a_cookie_and_accepts_the_retry_with_mac2() -> None:
    loop = Loopback.create()
    loop.b.force_under_load = True
    loop.send(loop.a, b"under load")

    assert loop.take(loop.b, Dropped) == [Dropped(DropReason.COOKIE_SENT)]
    assert not loop.take(loop.a, HandshakeCompleted)
    assert loop.a.peers[loop.b.public_key].cookies.has_cookie

    loop.advance(6.0)  # Rekey-Timeout + jitter: the retry carries mac2
    assert loop.take(loop.a, HandshakeCompleted) == [HandshakeCompleted(loop.b.public_key, True)]
    assert [bytes(d.payload) for d in loop.take(loop.b, Delivered)] == [b"under load"]
    assert loop.b.drops == {DropReason.COOKIE_SENT: 1}


def test_cookie_reply_goes_back_to_the_source_and_is_bound_to_it() -> None:
    loop = Loopback.create()
    loop.b.force_under_load = True
    first = _initiation(loop)
    events = loop.b.receive(first, loop.now, source=b"10.0.0.1:51820")
    reply, dropped = events
    assert isinstance(reply, Outgoing) and reply.peer is None
    assert reply.reply_to == b"10.0.0.1:51820"
    assert len(reply.data) == COOKIE_REPLY_SIZE and message_type(reply.data) == 3
    assert dropped == Dropped(DropReason.COOKIE_SENT)
    assert loop.a.receive(reply.data, loop.now) == []  # stored, nothing to send yet

    loop.now += 6.0
    retry = _initiation(loop)
    # The cookie is for 10.0.0.1:51820: from another source, mac2 does not verify.
    other = loop.b.receive(retry, loop.now, source=b"10.0.0.9:51820")
    assert other[-1] == Dropped(DropReason.COOKIE_SENT)
    accepted = loop.b.receive(retry, loop.now, source=b"10.0.0.1:51820")
    assert isinstance(accepted[0], Outgoing) and accepted[0].peer == loop.a.public_key


def test_a_cookie_reply_is_accepted_once_and_only_for_the_last_message() -> None:
    loop = Loopback.create()
    loop.b.force_under_load = True
    message = _initiation(loop)
    reply, _ = loop.b.receive(message, loop.now)
    assert isinstance(reply, Outgoing)
    assert loop.a.receive(reply.data, loop.now) == []
    assert loop.a.receive(reply.data, loop.now) == [
        Dropped(DropReason.BAD_COOKIE, loop.b.public_key)
    ]
    index = int.from_bytes(message[4:8], "little")
    forged = pack_cookie_reply(index, os.urandom(24), os.urandom(32))
    assert loop.a.receive(forged, loop.now) == [Dropped(DropReason.BAD_COOKIE, loop.b.public_key)]
    unknown = pack_cookie_reply(index ^ 1, os.urandom(24), os.urandom(32))
    assert loop.a.receive(unknown, loop.now) == [Dropped(DropReason.UNKNOWN_INDEX)]


def test_cookies_expire_after_two_minutes() -> None:
    loop = Loopback.create()
    loop.b.force_under_load = True
    reply, _ = loop.b.receive(_initiation(loop), loop.now)
    assert isinstance(reply, Outgoing)
    loop.a.receive(reply.data, loop.now)
    loop.now += COOKIE_REFRESH_TIME + 1
    stale = _initiation(loop)
    assert stale[-16:] == bytes(16)  # no mac2 with an expired cookie
    assert loop.b.receive(stale, loop.now)[-1] == Dropped(DropReason.COOKIE_SENT)


def test_load_is_detected_from_the_rate_of_handshakes() -> None:
    loop = Loopback.create(load_threshold=10)
    replayed = _initiation(loop)
    loop.b.receive(replayed, loop.now)  # the genuine one: answered
    for _ in range(9):
        loop.b.receive(replayed, loop.now)  # replays: each costs a DH before it is refused
    assert loop.b.drops[DropReason.STALE_TIMESTAMP] == 9
    assert not loop.b.under_load(loop.now)
    # The 11th handshake message within a second is one too many: cookies from now on.
    assert loop.b.receive(replayed, loop.now)[-1] == Dropped(DropReason.COOKIE_SENT)
    assert loop.b.under_load(loop.now)
    assert not loop.b.under_load(loop.now + 1.5)  # the load has passed


def test_under_load_each_source_is_rate_limited_even_with_a_valid_mac2() -> None:
    responder = Device(generate_private_key(), load_threshold=10_000)
    responder.force_under_load = True
    initiators = []
    for _ in range(SOURCE_BURST + 3):
        initiator = Device(generate_private_key())
        initiator.add_peer(responder.public_key)
        responder.add_peer(initiator.public_key)
        initiators.append(initiator)
    outcomes = []
    for initiator in initiators:
        [first] = initiator.send(responder.public_key, b"x", 0.0)
        reply, _ = responder.receive(first.data, 0.0, source=b"one address")
        assert isinstance(reply, Outgoing)
        initiator.receive(reply.data, 0.0)
        [retry] = initiator.tick(6.0)
        assert isinstance(retry, Outgoing)
        outcomes.append(responder.receive(retry.data, 6.0, source=b"one address")[0])
    answered = [o for o in outcomes if isinstance(o, Outgoing)]
    limited = [o for o in outcomes if o == Dropped(DropReason.RATE_LIMITED)]
    assert len(answered) == SOURCE_BURST and len(limited) == 3

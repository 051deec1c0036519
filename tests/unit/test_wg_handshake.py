"""libs.wg handshakes: Noise_IKpsk2 both ways, preshared keys, and what a responder refuses."""

from __future__ import annotations

import pytest

from libs.wg import (
    Delivered,
    Device,
    Dropped,
    DropReason,
    HandshakeCompleted,
    Outgoing,
    UnknownPeer,
    generate_preshared_key,
    generate_private_key,
    key_from_base64,
    key_to_base64,
    message_type,
    public_key,
)
from libs.wg.constants import INITIATION_SIZE, KEEPALIVE_SIZE, RESPONSE_SIZE
from libs.wg.crypto import INITIAL_CHAIN_KEY, INITIAL_HASH
from libs.wg.loopback import Loopback
from libs.wg.tai64n import Tai64nClock, tai64n


def _payloads(loop: Loopback, device: Device) -> list[bytes]:
    return [bytes(d.payload) for d in loop.take(device, Delivered)]


def test_protocol_constants_hash_to_the_known_initial_values() -> None:
    # HASH(Construction) and HASH(HASH(Construction) || Identifier), as every implementation has.
    assert INITIAL_CHAIN_KEY.hex() == (
        "60e26daef327efc02ec335e2a025d2d016eb4206f87277f52d38d1988b78cd36"
    )
    assert INITIAL_HASH.hex() == "2211b361081ac566691243db458ad5322d9c6c662293e8b70ee19c65ba079ef3"


def test_keys_are_raw_32_bytes_with_wireguard_base64() -> None:
    # RFC 7748, section 6.1: Alice's key pair.
    private = bytes.fromhex("77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a")
    expected = "8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a"
    assert public_key(private).hex() == expected
    text = key_to_base64(public_key(private))
    assert len(text) == 44 and key_from_base64(text) == public_key(private)
    generated = generate_private_key()
    assert generated[0] & 7 == 0 and generated[31] & 0xC0 == 0x40  # clamped like `wg genkey`
    for bad in ("", "not base64!", key_to_base64(private)[:-4], "AAAA"):
        with pytest.raises(ValueError):
            key_from_base64(bad)
    with pytest.raises(ValueError):
        Device(b"short")
    device = Device(generate_private_key())
    with pytest.raises(ValueError):
        device.add_peer(device.public_key)
    with pytest.raises(ValueError):
        device.add_peer(bytes(32))  # a low-order point: no shared secret
    with pytest.raises(UnknownPeer):
        device.send(public_key(generate_private_key()), b"x", 0.0)


@pytest.mark.parametrize("preshared", [False, True], ids=["no-psk", "psk"])
@pytest.mark.parametrize("initiator", ["a", "b"])
def test_handshake_completes_both_ways_and_data_flows(preshared: bool, initiator: str) -> None:
    loop = Loopback.create(generate_preshared_key() if preshared else None)
    first, second = (loop.a, loop.b) if initiator == "a" else (loop.b, loop.a)

    loop.connected = False
    loop.send(first, b"hello")
    [(_, initiation)] = loop.wire
    assert len(initiation) == INITIATION_SIZE and message_type(initiation) == 1
    loop.wire.clear()
    loop.connected = True
    loop.deliver(second, initiation)

    assert loop.take(first, HandshakeCompleted) == [HandshakeCompleted(second.public_key, True)]
    assert loop.take(second, HandshakeCompleted) == [HandshakeCompleted(first.public_key, False)]
    assert _payloads(loop, second) == [b"hello"]
    loop.send(second, b"world")
    assert _payloads(loop, first) == [b"world"]
    assert not first.drops and not second.drops
    assert first.has_session(second.public_key, loop.now)
    assert second.has_session(first.public_key, loop.now)


def test_initiator_confirms_at_once_with_a_keepalive_when_it_has_nothing_queued() -> None:
    loop = Loopback.create()
    loop.connected = False
    loop.route(loop.a, loop.a.initiate_handshake(loop.b.public_key, loop.now))
    [(_, initiation)] = loop.wire
    [response] = [e for e in loop.b.receive(initiation, 0.0) if isinstance(e, Outgoing)]
    assert len(response.data) == RESPONSE_SIZE and message_type(response.data) == 2
    # The responder has only a `next` session: it must not send before the initiator does.
    assert not loop.b.has_session(loop.a.public_key, 0.0)
    events = loop.a.receive(response.data, 0.0)
    assert events[0] == HandshakeCompleted(loop.b.public_key, True)
    [keepalive] = [e for e in events if isinstance(e, Outgoing)]
    assert len(keepalive.data) == KEEPALIVE_SIZE
    assert loop.b.receive(keepalive.data, 0.0) == [HandshakeCompleted(loop.a.public_key, False)]
    assert loop.b.has_session(loop.a.public_key, 0.0)


def test_responder_queues_until_the_initiator_uses_the_new_session() -> None:
    loop = Loopback.create()
    loop.connected = False
    loop.route(loop.a, loop.a.initiate_handshake(loop.b.public_key, 0.0))
    [(_, initiation)] = loop.wire
    loop.wire.clear()
    loop.deliver(loop.b, initiation)  # the response is held on the wire
    loop.send(loop.b, b"early")  # queued: B may not send on `next`
    assert [m for m in loop.held() if message_type(m) == 4] == []
    loop.connected = True
    for receiver, message in list(loop.wire):
        loop.deliver(receiver, message)
    assert _payloads(loop, loop.a) == [b"early"]


def test_mismatched_preshared_keys_fail_at_the_response() -> None:
    a, b = Device(generate_private_key()), Device(generate_private_key())
    a.add_peer(b.public_key, generate_preshared_key())
    b.add_peer(a.public_key, generate_preshared_key())
    loop = Loopback(a, b)
    loop.send(a, b"secret")
    assert loop.take(a, Dropped) == [Dropped(DropReason.HANDSHAKE_AUTH, b.public_key)]
    assert not loop.take(a, HandshakeCompleted) and not loop.take(b, Delivered)


def test_responder_refuses_strangers_wrong_recipients_and_replays() -> None:
    loop = Loopback.create()
    stranger = Device(generate_private_key())
    stranger.add_peer(loop.b.public_key)
    [initiation] = stranger.send(loop.b.public_key, b"let me in", 0.0)
    assert loop.b.receive(initiation.data, 0.0) == [Dropped(DropReason.UNKNOWN_PEER)]

    misdirected = Device(generate_private_key())
    misdirected.add_peer(loop.a.public_key)  # an initiation for A, delivered to B
    [initiation] = misdirected.send(loop.a.public_key, b"x", 0.0)
    assert loop.b.receive(initiation.data, 0.0) == [Dropped(DropReason.BAD_MAC1)]

    loop.connected = False
    loop.send(loop.a, b"once")
    [(_, genuine)] = loop.wire
    assert isinstance(loop.b.receive(genuine, 0.0)[0], Outgoing)
    replay = loop.b.receive(genuine, 1.0)
    assert replay == [Dropped(DropReason.STALE_TIMESTAMP, loop.a.public_key)]
    assert loop.b.drops == {
        DropReason.UNKNOWN_PEER: 1,
        DropReason.BAD_MAC1: 1,
        DropReason.STALE_TIMESTAMP: 1,
    }


def test_restarted_initiator_is_accepted_but_not_within_the_flood_interval() -> None:
    loop = Loopback.create()
    loop.send(loop.a, b"before restart")
    assert _payloads(loop, loop.b) == [b"before restart"]
    for delay, accepted in ((0.01, False), (0.5, True)):
        wall = 1.7e9 + 1 + delay
        restarted = Device(loop.a.private_key, wall_clock=lambda: wall)  # noqa: B023
        restarted.add_peer(loop.b.public_key)
        [initiation] = restarted.send(loop.b.public_key, b"after restart", loop.now + delay)
        events = loop.b.receive(initiation.data, loop.now + delay)
        if accepted:
            assert isinstance(events[0], Outgoing)
        else:
            assert events == [Dropped(DropReason.INITIATION_FLOOD, loop.a.public_key)]


def test_simultaneous_initiations_both_complete() -> None:
    loop = Loopback.create()
    loop.connected = False
    loop.send(loop.a, b"from a")
    loop.send(loop.b, b"from b")
    loop.connected = True
    held, loop.wire = loop.wire, []
    for receiver, message in held:
        loop.deliver(receiver, message)
    loop.advance(1.0)
    assert _payloads(loop, loop.b) == [b"from a"]
    assert _payloads(loop, loop.a) == [b"from b"]
    loop.send(loop.a, b"again")
    loop.send(loop.b, b"again")
    assert _payloads(loop, loop.b) == [b"again"] and _payloads(loop, loop.a) == [b"again"]


def test_a_response_is_consumed_once() -> None:
    loop = Loopback.create()
    loop.connected = False
    loop.route(loop.a, loop.a.initiate_handshake(loop.b.public_key, 0.0))
    [(_, initiation)] = loop.wire
    [response] = [e for e in loop.b.receive(initiation, 0.0) if isinstance(e, Outgoing)]
    assert isinstance(loop.a.receive(response.data, 0.0)[0], HandshakeCompleted)
    assert loop.a.receive(response.data, 0.0) == [Dropped(DropReason.UNKNOWN_INDEX)]


def test_tai64n_timestamps_grow_even_when_the_wall_clock_does_not() -> None:
    assert tai64n(0.0).hex() == "400000000000000a00000000"
    assert tai64n(1.5) > tai64n(1.0)
    assert tai64n(1.0 + 1e-3) == tai64n(1.0)  # nanoseconds rounded to 2^24 (about 16.8 ms)
    clock = Tai64nClock()
    stamps = [clock.stamp(t) for t in (100.0, 100.0, 99.0, 100.999999)]
    assert stamps == sorted(set(stamps))


def test_peer_status_and_removal() -> None:
    loop = Loopback.create()
    loop.send(loop.a, b"counted")
    status = loop.a.peer_status(loop.b.public_key, loop.now)
    assert status.has_session and status.last_handshake == 0.0 and status.queued == 0
    assert status.sent_bytes > 0 and status.received_bytes == 0  # B has sent nothing yet
    [message] = loop.a.send(loop.b.public_key, b"in flight", loop.now)
    loop.b.remove_peer(loop.a.public_key)
    assert loop.b.receive(message.data, loop.now) == [Dropped(DropReason.UNKNOWN_INDEX)]
    assert loop.b.index == {}
    with pytest.raises(UnknownPeer):
        loop.b.peer_status(loop.a.public_key, loop.now)

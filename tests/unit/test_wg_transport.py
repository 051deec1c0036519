"""libs.wg transport data: framing and padding, counters, the replay window, keepalives."""

from __future__ import annotations

import struct

import pytest

from libs.wg import (
    IP_PACKETS,
    MAX_MESSAGE_SIZE,
    MAX_PAYLOAD,
    Delivered,
    Device,
    Dropped,
    DropReason,
    Outgoing,
    message_type,
)
from libs.wg.constants import (
    COOKIE_REPLY_SIZE,
    INITIATION_SIZE,
    KEEPALIVE_SIZE,
    MAX_PLAINTEXT,
    REJECT_AFTER_MESSAGES,
    REPLAY_WINDOW,
    RESPONSE_SIZE,
)
from libs.wg.framing import SIZED, Framing
from libs.wg.loopback import Loopback
from libs.wg.messages import carried_bytes
from libs.wg.replay import ReplayWindow


def _established(**options: object) -> Loopback:
    loop = Loopback.create(**options)  # type: ignore[arg-type]
    loop.send(loop.a, b"hello")
    loop.take(loop.b, Delivered)
    return loop


def _sealed(loop: Loopback, sender: Device, payload: bytes) -> bytes:
    """One transport message from `sender`, not delivered."""
    [message] = sender.send(loop.peer_of(sender).public_key, payload, loop.now)
    return bytes(message.data)


def _counter(message: bytes) -> int:
    counter: int = struct.unpack_from("<Q", message, 8)[0]
    return counter


@pytest.mark.parametrize("size", [1, 13, 14, 15, 16, 1000, 16384, MAX_PAYLOAD])
def test_payloads_arrive_intact_padded_to_16(size: int) -> None:
    loop = _established()
    payload = bytes(range(256)) * (size // 256) + bytes(range(size % 256))
    message = _sealed(loop, loop.a, payload)
    plaintext = len(message) - KEEPALIVE_SIZE
    assert plaintext % 16 == 0 and size + 2 <= plaintext < size + 2 + 16
    assert len(message) <= MAX_MESSAGE_SIZE and message_type(message) == 4
    assert size < 16 or payload not in message  # ciphertext only
    [delivered] = loop.b.receive(message, loop.now)
    assert delivered == Delivered(loop.a.public_key, payload)


def test_oversized_payloads_are_refused_by_send() -> None:
    loop = _established()
    with pytest.raises(ValueError):
        loop.a.send(loop.b.public_key, bytes(MAX_PAYLOAD + 1), loop.now)


def test_the_payload_is_copied_when_queued() -> None:
    loop = Loopback.create()
    loop.connected = False
    buffer = bytearray(b"first")
    loop.send(loop.a, buffer)
    buffer[:] = b"reuse"
    loop.connected = True
    for receiver, message in loop.wire:
        loop.deliver(receiver, message)
    assert [bytes(d.payload) for d in loop.take(loop.b, Delivered)] == [b"first"]


def test_payloads_queued_before_a_session_arrive_intact_though_the_device_reuses_its_buffer() -> (
    None
):
    loop = Loopback.create()
    loop.connected = False
    payloads = [b"a" * 60_000, b"b" * 17, b"c" * 1000]
    for payload in payloads:
        loop.send(loop.a, payload)
    loop.connected = True
    for receiver, message in loop.wire:
        loop.deliver(receiver, message)
    assert [bytes(d.payload) for d in loop.take(loop.b, Delivered)] == payloads


@pytest.mark.parametrize("framing", [SIZED, IP_PACKETS], ids=["sized", "ip"])
def test_framing_into_a_used_buffer_is_the_same_plaintext_zero_padded(framing: Framing) -> None:
    buffer = bytearray(b"\xff" * MAX_PLAINTEXT)  # what a longer payload left behind
    packet = b"\x45" + bytes(1) + struct.pack(">H", 21) + bytes(16) + b"x"  # a 21-byte IPv4
    assert framing.encode_into(buffer, [packet]) == framing.encode(packet)
    assert framing.encode_into(buffer, [packet[:7], b"", packet[7:]]) == framing.encode(packet)


def test_counters_count_up_and_duplicates_and_old_messages_are_dropped() -> None:
    loop = _established()
    messages = [_sealed(loop, loop.a, b"%d" % i) for i in range(5)]
    assert [_counter(m) for m in messages] == [1, 2, 3, 4, 5]  # 0 confirmed the handshake
    for i in (4, 1, 3, 2):  # out of order, within the window
        assert loop.b.receive(messages[i], loop.now) == [
            Delivered(loop.a.public_key, bytearray(b"%d" % i))
        ]
    for i in (4, 1):
        assert loop.b.receive(messages[i], loop.now) == [
            Dropped(DropReason.REPLAYED, loop.a.public_key)
        ]
    assert loop.b.receive(messages[0], loop.now)[0] == Delivered(loop.a.public_key, bytearray(b"0"))
    assert loop.b.drops == {DropReason.REPLAYED: 2}


def test_messages_older_than_the_window_are_dropped() -> None:
    loop = _established()
    old = _sealed(loop, loop.a, b"old")
    session = loop.a.peers[loop.b.public_key].current
    assert session is not None
    session.send_counter += REPLAY_WINDOW + 1
    new = _sealed(loop, loop.a, b"new")
    assert isinstance(loop.b.receive(new, loop.now)[0], Delivered)
    assert loop.b.receive(old, loop.now) == [Dropped(DropReason.REPLAYED, loop.a.public_key)]


def test_tampered_and_unknown_messages_are_dropped() -> None:
    loop = _established()
    message = bytearray(_sealed(loop, loop.a, b"integrity"))
    message[-1] ^= 1
    assert loop.b.receive(message, loop.now) == [
        Dropped(DropReason.TRANSPORT_AUTH, loop.a.public_key)
    ]
    message[-1] ^= 1
    message[4] ^= 1  # another receiver index
    assert loop.b.receive(message, loop.now) == [Dropped(DropReason.UNKNOWN_INDEX)]
    message[4] ^= 1
    assert isinstance(loop.b.receive(message, loop.now)[0], Delivered)  # the forgeries cost nothing


def test_keepalive_is_an_empty_transport_message_and_is_not_delivered() -> None:
    loop = _established()
    [keepalive] = loop.a.send(loop.b.public_key, b"", loop.now)
    assert len(keepalive.data) == KEEPALIVE_SIZE
    assert loop.b.receive(keepalive.data, loop.now) == []
    assert loop.b.drops == {}


def test_ip_framing_strips_padding_from_ipv4_and_ipv6_packets() -> None:
    loop = _established(framing=IP_PACKETS)
    ipv4 = bytes([0x45, 0]) + struct.pack("!H", 23) + bytes(19)
    ipv6 = bytes([0x60]) + bytes(3) + struct.pack("!H", 3) + bytes(37)
    for packet in (ipv4, ipv6):
        message = _sealed(loop, loop.a, packet)
        assert (len(message) - KEEPALIVE_SIZE) % 16 == 0
        assert loop.b.receive(message, loop.now) == [Delivered(loop.a.public_key, packet)]
    for bad in (b"\x00not ip", ipv4[:2] + struct.pack("!H", 400) + ipv4[4:]):
        message = _sealed(loop, loop.a, bad)
        assert loop.b.receive(message, loop.now) == [
            Dropped(DropReason.BAD_PAYLOAD, loop.a.public_key)
        ]


def test_sized_framing_refuses_lengths_beyond_the_plaintext() -> None:
    plaintext = SIZED.encode(b"abc")
    assert len(plaintext) == 16 and bytes(plaintext[:5]) == b"\x00\x03abc"
    decoded = SIZED.decode(bytearray(plaintext))
    assert decoded is not None and bytes(decoded) == b"abc"
    assert SIZED.decode(bytearray(b"\xff\xff" + bytes(14))) is None
    assert SIZED.decode(bytearray(b"\x01")) is None


def test_message_type_checks_exact_sizes() -> None:
    assert message_type(b"\x01\0\0\0" + bytes(INITIATION_SIZE - 4)) == 1
    assert message_type(b"\x02\0\0\0" + bytes(RESPONSE_SIZE - 4)) == 2
    assert message_type(b"\x03\0\0\0" + bytes(COOKIE_REPLY_SIZE - 4)) == 3
    assert message_type(b"\x04\0\0\0" + bytes(KEEPALIVE_SIZE - 4)) == 4
    assert message_type(b"\x04\0\0\0" + bytes(MAX_MESSAGE_SIZE - 4)) == 4
    for bad in (
        b"",
        b"\x01",
        b"\x01\0\0\0" + bytes(INITIATION_SIZE - 3),
        b"\x02\0\0\0" + bytes(RESPONSE_SIZE - 5),
        b"\x03\0\0\0" + bytes(COOKIE_REPLY_SIZE),
        b"\x04\0\0\0" + bytes(KEEPALIVE_SIZE - 5),
        b"\x04\0\0\0" + bytes(MAX_MESSAGE_SIZE - 3),
        b"\x05\0\0\0" + bytes(60),
        b"\x01\0\0\x01" + bytes(INITIATION_SIZE - 4),  # reserved bytes must be zero
    ):
        assert message_type(bad) is None


def test_replay_window_rules() -> None:
    window = ReplayWindow()
    assert window.accept(0) and not window.accept(0)
    assert window.accept(10) and window.accept(5) and not window.accept(5)
    assert window.accept(20 + REPLAY_WINDOW)
    assert window.accept(20)  # exactly the window's width behind: still inside
    assert not window.accept(19)  # behind the window
    assert not window.accept(10)
    far = 10**9
    assert window.could_accept(far) and window.accept(far)
    assert not window.could_accept(far)
    assert window.accept(far - 1) and window.accept(far - REPLAY_WINDOW)
    assert not window.accept(far - REPLAY_WINDOW - 1)
    assert not window.could_accept(REJECT_AFTER_MESSAGES)
    assert not window.accept(REJECT_AFTER_MESSAGES)
    # A jump of exactly one ring clears every stale bit: no false duplicates.
    ring = ReplayWindow()
    for counter in range(0, 64 * 128, 7):
        assert ring.accept(counter)
    for counter in range(64 * 128, 2 * 64 * 128, 7):
        assert ring.accept(counter)
    assert ring.greatest is not None and ring.greatest >= 64 * 128


def test_every_outgoing_message_is_well_formed() -> None:
    loop = Loopback.create()
    loop.connected = False
    loop.send(loop.a, b"x" * 100)
    loop.connected = True
    seen = []
    for receiver, message in loop.wire:
        seen.append(message_type(message))
        events = receiver.receive(message, loop.now)
        for event in events:
            if isinstance(event, Outgoing):
                seen.append(message_type(event.data))
                other = loop.peer_of(receiver)
                for reply in other.receive(event.data, loop.now):
                    if isinstance(reply, Outgoing):
                        seen.append(message_type(reply.data))
    # Initiation, response, the queued payload (a keepalive only when nothing is queued).
    assert seen == [1, 2, 4]


def test_what_a_message_carries_is_its_plaintext_and_nothing_for_wireguards_own() -> None:
    transport = b"\x04\x00\x00\x00" + bytes(12) + bytes(1024) + bytes(16)
    assert carried_bytes(transport) == 1024
    assert carried_bytes(transport[:32]) == 0, "a keepalive"
    assert carried_bytes(b"\x01\x00\x00\x00" + bytes(144)) == 0, "a handshake initiation"

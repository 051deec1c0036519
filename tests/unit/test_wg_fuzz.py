"""libs.wg under hostile input (S3): `receive` never raises, and what it refuses is a counted
`Dropped`. Also: whatever the network does to the order of messages (loss, duplication,
reordering), a payload is delivered at most once and only as it was sent."""

from __future__ import annotations

import struct
from functools import cache

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from libs.wg import IP_PACKETS, SIZED, Delivered, Device, Dropped, Outgoing, message_type
from libs.wg.constants import (
    COOKIE_REPLY_SIZE,
    INITIATION_SIZE,
    KEEPALIVE_SIZE,
    RESPONSE_SIZE,
)
from libs.wg.loopback import Loopback

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@cache
def _captured() -> tuple[Loopback, dict[int, bytes]]:
    """An established pair, and one genuine message of each type sent between them."""
    loop = Loopback.create()
    loop.b.force_under_load = True
    loop.connected = False
    loop.send(loop.a, b"first")
    [(_, initiation)] = loop.wire
    [cookie_reply, _] = loop.b.receive(initiation, 0.0)
    assert isinstance(cookie_reply, Outgoing)
    loop.b.force_under_load = False
    [response] = loop.b.receive(initiation, 0.0)
    assert isinstance(response, Outgoing)
    events = loop.a.receive(response.data, 0.0)
    [transport] = [e for e in events if isinstance(e, Outgoing)]
    loop.b.receive(transport.data, 0.0)
    [data] = loop.a.send(loop.b.public_key, b"payload " * 40, 0.0)
    samples = {
        1: bytes(initiation),
        2: bytes(response.data),
        3: bytes(cookie_reply.data),
        4: bytes(data.data),
    }
    return loop, samples


def _only_drops(device: Device, message: bytes) -> None:
    before = sum(device.drops.values())
    events = device.receive(message, 1.0, source=b"fuzz")
    drops = [e for e in events if isinstance(e, Dropped)]
    assert drops, events
    assert all(isinstance(e, Dropped | Outgoing) for e in events), events
    # Only a cookie reply may answer junk, and only to a handshake with a valid mac1.
    assert all(e.peer is None for e in events if isinstance(e, Outgoing))
    assert sum(device.drops.values()) == before + len(drops)


@SETTINGS
@given(st.binary(max_size=300))
def test_random_bytes_are_dropped(data: bytes) -> None:
    loop, _ = _captured()
    for device in (loop.a, loop.b):
        _only_drops(device, data)


@SETTINGS
@given(
    st.sampled_from([1, 2, 4]),
    st.integers(min_value=0, max_value=10**6),
    st.binary(min_size=0, max_size=200),
)
def test_random_bodies_with_valid_headers_are_dropped(kind: int, index: int, body: bytes) -> None:
    loop, _ = _captured()
    size = {1: INITIATION_SIZE, 2: RESPONSE_SIZE, 3: COOKIE_REPLY_SIZE}.get(kind)
    length = size if size is not None else KEEPALIVE_SIZE + len(body)
    message = (struct.pack("<II", kind, index) + body).ljust(length, b"\0")[:length]
    assert message_type(message) == kind
    for device in (loop.a, loop.b):
        _only_drops(device, message)


@SETTINGS
@given(
    st.sampled_from([1, 2, 3, 4]),
    st.lists(
        st.tuples(st.integers(min_value=0, max_value=10_000), st.integers(1, 255)),
        min_size=1,
        max_size=6,
    ),
    st.sampled_from(["flip", "truncate", "extend"]),
)
def test_mutated_genuine_messages_are_dropped(
    kind: int, flips: list[tuple[int, int]], how: str
) -> None:
    loop, samples = _captured()
    message = bytearray(samples[kind])
    if how == "flip":
        for position, mask in flips:
            message[position % len(message)] ^= mask
    elif how == "truncate":
        del message[-(flips[0][0] % len(message)) - 1 :]
    else:
        message += bytes(mask for _, mask in flips)
    assume(bytes(message) != samples[kind])
    for device in (loop.a, loop.b):
        _only_drops(device, bytes(message))


@SETTINGS
@given(st.binary(min_size=1, max_size=200))
def test_framing_decodes_any_plaintext_without_raising(plaintext: bytes) -> None:
    for framing in (SIZED, IP_PACKETS):
        payload = framing.decode(bytearray(plaintext))
        assert payload is None or len(payload) <= len(plaintext)


# Network schedules: each step sends a payload, delivers, duplicates, drops or delays one
# message in flight, or lets time pass.
_ACTIONS = ["deliver"] * 5 + ["duplicate", "drop", "delay", "send", "send", "tick"]
_STEP = st.tuples(st.sampled_from(_ACTIONS), st.integers(0, 50))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_STEP, min_size=1, max_size=80))
def test_any_network_schedule_delivers_payloads_at_most_once_intact_and_recovers(
    schedule: list[tuple[str, int]],
) -> None:
    loop = Loopback.create()
    loop.connected = False
    sent: dict[bytes, list[bytes]] = {loop.a.public_key: [], loop.b.public_key: []}
    delivered: dict[bytes, list[bytes]] = {loop.a.public_key: [], loop.b.public_key: []}
    counter = 0

    def collect() -> None:
        for device in (loop.a, loop.b):
            delivered[device.public_key] += [bytes(d.payload) for d in loop.take(device, Delivered)]

    for action, number in schedule:
        if action == "send" or not loop.wire:
            sender = loop.a if number % 2 else loop.b
            counter += 1
            payload = b"payload %d " % counter + bytes(number)
            sent[sender.public_key].append(payload)
            loop.send(sender, payload)
            continue
        position = number % len(loop.wire)
        if action == "tick":
            loop.now += number / 10
            loop.tick()
        elif action == "drop":
            del loop.wire[position]
        elif action == "delay":
            loop.wire.append(loop.wire.pop(position))
        else:
            receiver, message = loop.wire[position]
            if action == "deliver":
                del loop.wire[position]
            loop.route(receiver, receiver.receive(message, loop.now))

    # The network heals: what is still in flight arrives, then the pair must recover (as a
    # protocol above it would, by sending again when nothing came back).
    loop.connected = True
    held, loop.wire = loop.wire, []
    for receiver, message in held:
        loop.route(receiver, receiver.receive(message, loop.now))
    for attempt in range(4):
        for sender in (loop.a, loop.b):
            payload = b"final %d" % attempt
            sent[sender.public_key].append(payload)
            loop.send(sender, payload)
        loop.advance(20, step=0.5)
        collect()
        if all(any(p.startswith(b"final") for p in got) for got in delivered.values()):
            break
    for device in (loop.a, loop.b):
        got = delivered[device.public_key]
        assert len(got) == len(set(got)), "a payload was delivered twice"
        assert set(got) <= set(sent[loop.peer_of(device).public_key])
        assert any(p.startswith(b"final") for p in got), "the pair did not recover"

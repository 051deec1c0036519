"""The in-tunnel stream protocol: streams open, carry bytes under credit, close; and when the
transport loses a tail of messages (a relay died) a retransmit delivers everything once, in
order, on streams that never reset."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libs.tunnel import (
    Closed,
    CreditAvailable,
    Data,
    Link,
    LinkError,
    OpenResult,
    Reset,
    StreamOpened,
)
from libs.tunnel.link import HEADER


class Pair:
    """Two links and the payloads in flight between them; `lose` drops what is in flight."""

    def __init__(self, window: int = 64 * 1024) -> None:
        self.a = Link(0, window=window)
        self.b = Link(1, window=window)
        self.to_b: list[bytes] = []
        self.to_a: list[bytes] = []
        self.events_a: list[object] = []
        self.events_b: list[object] = []

    def pump(self, rounds: int = 50) -> None:
        for _ in range(rounds):
            self.to_b += self.a.outgoing()
            self.to_a += self.b.outgoing()
            if not self.to_a and not self.to_b:
                self.a.tick(0.0)
                self.b.tick(0.0)
                self.to_b += self.a.outgoing()
                self.to_a += self.b.outgoing()
                if not self.to_a and not self.to_b:
                    return
            for payload in self.to_b:
                self.events_b += self.b.receive(payload)
            for payload in self.to_a:
                self.events_a += self.a.receive(payload)
            self.to_a, self.to_b = [], []

    def lose_in_flight(self) -> None:
        self.to_a, self.to_b = [], []


def open_pair(pair: Pair, port: int = 29500) -> int:
    stream = pair.a.open_stream(port)
    pair.pump(1)
    assert StreamOpened(stream, port) in pair.events_b
    pair.b.accept(stream)
    pair.pump()
    assert OpenResult(stream, True, 0) in pair.events_a
    return stream


def received(events: list[object], stream: int) -> bytes:
    return b"".join(e.data for e in events if isinstance(e, Data) and e.stream == stream)


def test_a_stream_opens_carries_bytes_both_ways_and_closes() -> None:
    pair = Pair()
    stream = open_pair(pair)
    assert pair.a.send(stream, b"hello") == 5
    assert pair.b.send(stream, b"world") == 5
    pair.pump()
    assert received(pair.events_b, stream) == b"hello"
    assert received(pair.events_a, stream) == b"world"
    pair.a.finish(stream)
    pair.pump()
    assert Closed(stream) in pair.events_b
    pair.b.finish(stream)
    pair.pump()
    assert Closed(stream) in pair.events_a
    assert stream not in pair.a.streams and stream not in pair.b.streams
    assert pair.a.unacked == 0 and pair.b.unacked == 0


def test_a_refused_open_reports_the_socks_code() -> None:
    pair = Pair()
    stream = pair.a.open_stream(1)
    pair.pump(1)
    pair.b.refuse(stream, 5)
    pair.pump()
    assert OpenResult(stream, False, 5) in pair.events_a
    assert stream not in pair.a.streams


def test_credit_bounds_what_is_in_flight_and_comes_back_as_it_is_consumed() -> None:
    pair = Pair(window=64 * 1024)
    stream = open_pair(pair)
    blob = bytes(range(256)) * 1024  # 256 KiB
    taken = pair.a.send(stream, blob)
    assert taken == 64 * 1024 and pair.a.credit(stream) == 0
    pair.pump()
    assert len(received(pair.events_b, stream)) == taken
    pair.b.consumed(stream, taken)
    pair.pump()
    assert CreditAvailable(stream) in pair.events_a
    assert pair.a.credit(stream) == 64 * 1024


def test_a_lost_tail_is_resent_once_in_order() -> None:
    pair = Pair(window=1 << 20)
    stream = open_pair(pair)
    blob = random.Random(7).randbytes(300_000)
    pair.a.send(stream, blob[:150_000])
    pair.to_b += pair.a.outgoing()
    delivered = pair.to_b[:2]  # the relay delivered two payloads, then died with the rest
    pair.lose_in_flight()
    for payload in delivered:
        pair.events_b += pair.b.receive(payload)
    pair.a.send(stream, blob[150_000:])
    pair.a.retransmit()  # the member moved to the other relay
    pair.pump()
    assert received(pair.events_b, stream) == blob
    assert not any(isinstance(e, Reset) for e in pair.events_a + pair.events_b)
    assert pair.a.stats["retransmits"] == 1
    assert pair.a.unacked == 0


def test_stalled_acknowledgements_trigger_a_resend_after_the_timeout() -> None:
    a, b = Link(0), Link(1)
    stream = a.open_stream(80)
    a.outgoing()  # lost
    assert not a.tick(0.0)
    assert a.tick(a.rto + 0.1)
    events = [e for p in a.outgoing() for e in b.receive(p)]
    assert StreamOpened(stream, 80) in events


def test_malformed_input_is_a_link_error() -> None:
    link = Link(1)
    with pytest.raises(LinkError):
        link.receive(b"\x01\x00")
    with pytest.raises(LinkError):
        link.receive(HEADER.pack(1, 0, 3, 100) + b"short")
    with pytest.raises(LinkError):
        link.receive(HEADER.pack(99, 0, 3, 0))
    with pytest.raises(LinkError):  # an open with our own stream parity
        Link(0).receive(HEADER.pack(1, 0, 2, 6) + b"\x00" * 6)


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 40_000), min_size=1, max_size=12),
    losses=st.lists(st.integers(0, 6), max_size=4),
    seed=st.integers(0, 2**16),
)
def test_any_pattern_of_lost_tails_delivers_every_byte_once_in_order(
    sizes: list[int], losses: list[int], seed: int
) -> None:
    rng = random.Random(seed)
    pair = Pair(window=1 << 20)
    streams = [open_pair(pair, port) for port in (1000, 1001)]
    sent: dict[int, bytearray] = {s: bytearray() for s in streams}
    loss_points = list(losses)
    for size in sizes:
        stream = rng.choice(streams)
        chunk = rng.randbytes(size)
        taken = pair.a.send(stream, chunk)
        sent[stream] += chunk[:taken]
        pair.to_b += pair.a.outgoing()
        if loss_points:
            keep = loss_points.pop()
            delivered = pair.to_b[:keep]
            pair.lose_in_flight()
            for payload in delivered:
                pair.events_b += pair.b.receive(payload)
            pair.a.retransmit()
        pair.pump()
        for stream_id in streams:
            got = len(received(pair.events_b, stream_id))
            if got:
                pair.b.consumed(stream_id, got)
    pair.pump()
    for stream in streams:
        assert received(pair.events_b, stream) == bytes(sent[stream])


def test_resends_without_progress_back_off() -> None:
    a = Link(0)
    a.open_stream(80)
    a.outgoing()  # lost, and the peer is slow to answer
    a.tick(0.0)
    assert a.tick(a.rto + 0.1)  # first resend after one timeout
    a.outgoing()
    assert not a.tick(a.rto * 2)  # the next waits twice as long ...
    assert a.tick(a.rto + 0.1 + 2 * a.rto + 0.1)  # ... then resends
    assert a.stats["retransmits"] == 2


def accept_all(a: Link, b: Link) -> None:
    """b accepts every stream a opened; a learns it."""
    for payload in a.outgoing():
        for event in b.receive(payload):
            if isinstance(event, StreamOpened):
                b.accept(event.stream)
    for payload in b.outgoing():
        a.receive(payload)


def test_the_link_holds_streams_back_at_its_in_flight_cap_and_wakes_them_on_ack() -> None:
    a, b = Link(0, window=1 << 20, max_inflight=64 * 1024), Link(1, window=1 << 20)
    streams = [a.open_stream(80 + i) for i in range(3)]
    accept_all(a, b)
    # Three streams, each with a megabyte of credit, share 64 KiB of room on the link: the
    # first send may overshoot it (a send is never split), then nobody sends until acks.
    taken = [a.send(s, b"x" * 100_000) if a.credit(s) else 0 for s in streams]
    assert taken == [100_000, 0, 0]
    assert all(a.credit(s) == 0 for s in streams)
    for payload in a.outgoing():
        b.receive(payload)
    b.tick(0.0)  # the receiver acknowledges what it took
    woken: list[object] = []
    for payload in b.outgoing():
        woken += a.receive(payload)
    assert {e.stream for e in woken if isinstance(e, CreditAvailable)} == set(streams)
    assert all(a.credit(s) > 0 for s in streams)


def test_a_send_the_stream_had_credit_for_is_taken_whole_even_if_others_filled_the_link() -> None:
    """Found by iperf3 -P 8 --json: a stream that read as much as its credit allowed, while
    other streams filled the link's room, lost the part the link no longer took (iperf3's
    TEST_END on its control connection)."""
    a, b = Link(0, window=1 << 20, max_inflight=64 * 1024), Link(1, window=1 << 20)
    bulk, control = a.open_stream(5201), a.open_stream(5201)
    accept_all(a, b)
    allowed = a.credit(control)
    assert allowed > 0
    a.send(bulk, b"x" * (1 << 20))  # fills the link while the control stream reads
    assert a.send(control, b"\x04") == 1  # TEST_END: all of it, or nothing would tell
    got = [e for p in a.outgoing() for e in b.receive(p) if isinstance(e, Data)]
    assert b"".join(e.data for e in got if e.stream == control) == b"\x04"


def test_next_deadline_says_when_tick_has_work() -> None:
    """What the tunnel sleeps until: nothing to time on an idle link; an owed acknowledgement
    or a resend clock to start at once; then the resend fallback's time, doubling with each
    resend that brought no progress."""
    pair = Pair()
    assert pair.a.next_deadline(1.0) is None
    stream = open_pair(pair)
    pair.a.send(stream, b"x" * 100)
    pair.to_b += pair.a.outgoing()
    assert pair.a.next_deadline(1.0) == 1.0  # unacknowledged: the resend clock starts
    assert not pair.a.tick(1.0)
    assert pair.a.next_deadline(1.5) == 1.0 + pair.a.rto
    assert pair.a.tick(1.0 + pair.a.rto + 0.01)  # the fallback resend, due to go out
    assert pair.a.next_deadline(3.5) is None  # the flush that `tick` asked for times it
    pair.to_b += pair.a.outgoing()
    assert pair.a.next_deadline(4.0) == 1.0 + pair.a.rto + 0.01 + 2 * pair.a.rto
    for payload in pair.to_b:
        pair.b.receive(payload)
    assert pair.b.next_deadline(5.0) == 5.0  # an acknowledgement is owed
    pair.b.tick(5.0)
    pair.a.receive(b"".join(pair.b.outgoing()))
    assert pair.b.next_deadline(5.0) is None
    assert pair.a.next_deadline(5.0) is None  # acknowledged: nothing left to time


def opened() -> tuple[Link, Link, int]:
    """Two links and a stream a opened to b, its open acknowledged."""
    a, b = Link(0), Link(1)
    stream = a.open_stream(80)
    for event in [e for p in a.outgoing() for e in b.receive(p)]:
        b.accept(event.stream)
    b.keepalive()  # acknowledges the open
    for payload in b.outgoing():
        a.receive(payload)
    return a, b, stream


def test_what_is_sent_again_after_a_path_change_comes_apart_from_what_is_new() -> None:
    """The member counts what its programs sent once (the relays bill that): resends go in
    payloads of their own, ahead of the fresh messages."""
    a, b, stream = opened()
    a.send(stream, b"x" * 1000)
    resent, fresh = (list(map(b"".join, part)) for part in a.outgoing_parts())
    assert resent == [] and sum(map(len, fresh)) == 1000 + HEADER.size  # lost on a dead relay
    a.retransmit()
    a.send(stream, b"y" * 500)
    resent, fresh = (list(map(b"".join, part)) for part in a.outgoing_parts())
    assert sum(map(len, resent)) == 1000 + HEADER.size
    assert sum(map(len, fresh)) == 500 + HEADER.size
    got = [e for p in resent + fresh for e in b.receive(p) if isinstance(e, Data)]
    assert b"".join(e.data for e in got) == b"x" * 1000 + b"y" * 500


def test_a_sender_holding_its_messages_still_acknowledges_and_learns_when_it_may_move() -> None:
    """A move home to a relay back up: the sender holds its numbered messages until what is
    in flight is acknowledged, acknowledging the peer's meanwhile, then sends the held ones
    on the new path; nothing is sent twice, and the peer takes them in order."""
    a, b, stream = opened()
    a.send(stream, b"x" * 1000)
    in_flight = b"".join(b"".join(p) for p in a.outgoing_parts()[1])
    assert a.awaiting_acknowledgement == 1
    a.send(stream, b"y" * 500)  # held: a.outgoing_parts() is not called while moving
    assert a.awaiting_acknowledgement == 1  # the held message is not in flight
    b.send(stream, b"z" * 10)  # the peer sends too
    for payload in b.outgoing():
        a.receive(payload)  # b's data (b has not had the x's yet)
    a.tick(0.0)  # its timers: an acknowledgement is owed
    ack = a.acknowledgement_parts()
    assert len(ack) == 1 and a.acknowledgement_parts() == []  # due once, numbered nothing
    got = b.receive(in_flight)  # the old path delivers what was in flight
    b.keepalive()
    for payload in b.outgoing():
        a.receive(payload)
    assert a.awaiting_acknowledgement == 0  # now it may move
    resent, fresh = a.outgoing_parts()
    assert resent == []
    got += [e for p in fresh for e in b.receive(b"".join(p))]
    data = b"".join(e.data for e in got if isinstance(e, Data))
    assert data == b"x" * 1000 + b"y" * 500 and b.stats["duplicates"] == 0


def test_what_the_link_keeps_to_resend_does_not_change_with_the_callers_buffer() -> None:
    """A DATA message is kept as a view of what was sent: a buffer the caller may change
    afterwards is copied first, so a resend after a relay died carries the bytes sent."""
    a, b = Link(0), Link(1)
    stream = a.open_stream(80)
    b.receive(b"".join(a.outgoing()))
    b.accept(stream)
    a.receive(b"".join(b.outgoing()))
    buffer = bytearray(b"first")
    a.send(stream, buffer)
    a.outgoing()  # lost on a dead relay
    buffer[:] = b"later"
    a.retransmit()
    got = [e for p in a.outgoing() for e in b.receive(p) if isinstance(e, Data)]
    assert [bytes(e.data) for e in got] == [b"first"]

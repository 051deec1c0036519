"""The relay frame codec: every frame round-trips, any byte split decodes the same, and
malformed input of any shape is a FrameError, never another exception (S3)."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libs.relayproto import (
    Absent,
    Challenge,
    ErrorFrame,
    Forward,
    Frame,
    FrameDecoder,
    FrameError,
    Hello,
    Home,
    MeshHello,
    Ping,
    Pong,
    PresenceDump,
    Present,
    Recv,
    Route,
    Send,
    Sent,
    Welcome,
    encode,
    parts,
)
from libs.tunnel import Link, LinkError

KEY = os.urandom(32)
WG = b"\x04\x00\x00\x00" + bytes(12) + bytes(32) + bytes(16)
FRAMES: list[Frame] = [
    Challenge(KEY, os.urandom(32)),
    Hello("acme.rl", 3, "vast-a", KEY, os.urandom(32)),
    Welcome("relay-0", "eu-central", 500_000_000),
    Send(KEY, WG),
    Recv(KEY, WG),
    Ping(b"12345678"),
    Pong(b"12345678"),
    ErrorFrame("NotAMember", "no"),
    Home(True),
    Sent(1 << 40),
    MeshHello("relay-1", os.urandom(32)),
    Route("relay-h-4432"),
    Present(KEY, "acme.rl", 3),
    PresenceDump((Present(KEY, "a.b", 1), Present(os.urandom(32), "c.d", 2))),
    Absent(KEY),
    Forward(KEY, os.urandom(32), WG),
]


@pytest.mark.parametrize("frame", FRAMES, ids=lambda f: type(f).__name__)
def test_every_frame_round_trips(frame: Frame) -> None:
    assert FrameDecoder().feed(encode(frame)) == [frame]


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(0, 2000), max_size=10))
def test_any_split_of_the_stream_decodes_the_same(cuts: list[int]) -> None:
    data = b"".join(encode(f) for f in FRAMES)
    decoder = FrameDecoder()
    got = []
    at = 0
    for cut in sorted(c % (len(data) + 1) for c in cuts):
        got += decoder.feed(data[at:cut])
        at = cut
    got += decoder.feed(data[at:])
    assert got == FRAMES and decoder.buffered == 0


@pytest.mark.parametrize("frame", FRAMES, ids=lambda f: type(f).__name__)
def test_a_frame_written_in_parts_is_its_encoding(frame: Frame) -> None:
    assert b"".join(parts(frame)) == encode(frame)


def test_a_message_read_whole_is_handed_on_without_a_copy() -> None:
    """The relayed hot path: a relay forwards what it read, it does not copy each message."""
    message = WG + os.urandom(60_000)
    read = encode(Send(KEY, message)) * 3
    frames = FrameDecoder().feed(read)
    assert [f.message for f in frames] == [message] * 3  # type: ignore[union-attr]
    for frame in frames:
        assert isinstance(frame, Send) and isinstance(frame.message, memoryview)
        assert frame.message.obj is read and frame.message.readonly
        assert parts(Recv(KEY, frame.message))[1] is frame.message


def test_a_buffer_the_caller_changes_after_feeding_does_not_change_what_was_decoded() -> None:
    buffer = bytearray(encode(Send(KEY, WG)))
    [frame] = FrameDecoder().feed(buffer)
    buffer[-1] ^= 0xFF
    assert frame == Send(KEY, WG)


@settings(max_examples=500, deadline=None)
@given(data=st.binary(max_size=300))
def test_malformed_bytes_are_a_frame_error_or_nothing(data: bytes) -> None:
    try:
        FrameDecoder().feed(data)
    except FrameError:
        pass


# The shortest body each frame type has (its fixed fields, empty strings, nothing more).
SHORTEST_FRAMES: list[Frame] = [
    Challenge(KEY, bytes(32)),
    Hello("", 0, "", KEY, bytes(32)),
    Welcome("", "", 0),
    Send(KEY, b""),
    Recv(KEY, b""),
    Ping(bytes(8)),
    Pong(bytes(8)),
    ErrorFrame("", ""),
    Home(False),
    Sent(0),
    MeshHello("", bytes(32)),
    Route(""),
    Present(KEY, "", 0),
    PresenceDump(()),
    Absent(KEY),
    Forward(KEY, KEY, b""),
]
SHORTEST_BODY = {type(frame): len(encode(frame)) - 5 for frame in SHORTEST_FRAMES}
TYPE_OF = {encode(frame)[4]: type(frame) for frame in FRAMES}
# Frames whose last field is not "the rest of the body": a byte after it is garbage.
BOUNDED = [f for f in FRAMES if not isinstance(f, Send | Recv | Forward)]


def _framed(kind: int, body: bytes) -> bytes:
    return (1 + len(body)).to_bytes(4, "big") + bytes([kind]) + body


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_well_framed_garbage_bodies_are_frame_errors(data: st.DataObject) -> None:
    """A frame whose length is right but whose body is no frame: a type nobody defined, or a
    known type's body cut short of its fixed fields."""
    kind = data.draw(st.integers(0, 255), label="kind")
    known = TYPE_OF.get(kind)
    if known is None:
        body = data.draw(st.binary(max_size=120), label="body")
    else:
        body = data.draw(st.binary(max_size=SHORTEST_BODY[known] - 1), label="short body")
    with pytest.raises(FrameError):
        FrameDecoder().feed(_framed(kind, body))


@pytest.mark.parametrize("frame", BOUNDED, ids=lambda f: type(f).__name__)
@pytest.mark.parametrize("extra", [b"\x00", os.urandom(7)])
def test_a_frame_with_bytes_after_its_last_field_is_a_frame_error(
    frame: Frame, extra: bytes
) -> None:
    encoded = encode(frame)
    with pytest.raises(FrameError):
        FrameDecoder().feed(_framed(encoded[4], encoded[5:] + extra))


def test_a_home_flag_other_than_0_or_1_is_a_frame_error() -> None:
    with pytest.raises(FrameError):
        FrameDecoder().feed(_framed(encode(Home(True))[4], b"\x02"))


@settings(max_examples=500, deadline=None)
@given(data=st.binary(max_size=300))
def test_malformed_link_input_is_a_link_error_or_ignored(data: bytes) -> None:
    link = Link(1)
    try:
        link.receive(data)
    except LinkError:
        pass

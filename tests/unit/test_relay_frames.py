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
    Send,
    Welcome,
    encode,
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
    MeshHello("relay-1", os.urandom(32)),
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


@settings(max_examples=500, deadline=None)
@given(data=st.binary(max_size=300))
def test_malformed_bytes_are_a_frame_error_or_nothing(data: bytes) -> None:
    try:
        FrameDecoder().feed(data)
    except FrameError:
        pass


@settings(max_examples=300, deadline=None)
@given(kind=st.integers(0, 255), body=st.binary(max_size=120))
def test_well_framed_garbage_bodies_are_frame_errors(kind: int, body: bytes) -> None:
    framed = (1 + len(body)).to_bytes(4, "big") + bytes([kind]) + body
    try:
        FrameDecoder().feed(framed)
    except FrameError:
        pass


@settings(max_examples=500, deadline=None)
@given(data=st.binary(max_size=300))
def test_malformed_link_input_is_a_link_error_or_ignored(data: bytes) -> None:
    link = Link(1)
    try:
        link.receive(data)
    except LinkError:
        pass

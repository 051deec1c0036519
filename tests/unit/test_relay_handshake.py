"""The opening of a relay connection, sans-I/O: each side in order, frames that arrive with
the last handshake frame kept for the session (a relay may send Welcome and the first
forwarded message in one TCP read), refusals and out-of-order frames as clear errors."""

from __future__ import annotations

import asyncio

import pytest

from libs.relayproto import (
    Challenge,
    ErrorFrame,
    FrameError,
    Hello,
    MeshHello,
    Recv,
    Route,
    Send,
    Welcome,
    encode,
)
from libs.relayproto.connection import open_connection
from libs.relayproto.handshake import AcceptorHandshake, DialerHandshake, HandshakeRefused

KEY = b"k" * 32
HELLO = Hello("acme.g", 1, "a", b"w" * 32, b"p" * 32)
MESSAGE = b"\x04\x00\x00\x00" + bytes(28)


def test_the_dialer_answers_the_challenge_then_keeps_what_follows_welcome() -> None:
    dialer = DialerHandshake(lambda challenge: HELLO)
    assert dialer.receive(Challenge(KEY, b"n" * 32)) == HELLO
    assert not dialer.established
    for frame in (Welcome("relay-0", "eu", 0), Recv(KEY, MESSAGE), Recv(KEY, MESSAGE + b"2")):
        assert dialer.receive(frame) is None
    assert dialer.established and dialer.welcome == Welcome("relay-0", "eu", 0)
    assert dialer.take_session_frames() == [Recv(KEY, MESSAGE), Recv(KEY, MESSAGE + b"2")]
    assert dialer.take_session_frames() == []


def test_the_dialer_reports_a_refusal_and_frames_out_of_order() -> None:
    dialer = DialerHandshake(lambda challenge: HELLO)
    dialer.receive(Challenge(KEY, b"n" * 32))
    with pytest.raises(HandshakeRefused, match="NotAMember: who are you"):
        dialer.receive(ErrorFrame("NotAMember", "who are you"))
    with pytest.raises(FrameError, match="expected a challenge"):
        DialerHandshake(lambda challenge: HELLO).receive(Welcome("r", "eu", 0))


def test_the_acceptor_challenges_first_and_keeps_what_follows_the_hello() -> None:
    acceptor = AcceptorHandshake(KEY)
    assert acceptor.challenge.relay_key == KEY and len(acceptor.nonce) == 32
    assert AcceptorHandshake(KEY).nonce != acceptor.nonce  # fresh every time
    acceptor.receive(HELLO)
    acceptor.receive(Send(KEY, MESSAGE))
    assert acceptor.hello == HELLO and acceptor.take_session_frames() == [Send(KEY, MESSAGE)]
    mesh = AcceptorHandshake(KEY)
    mesh.receive(MeshHello("relay-1", b"p" * 32))
    assert isinstance(mesh.hello, MeshHello)
    with pytest.raises(FrameError, match="expected hello"):
        AcceptorHandshake(KEY).receive(Send(KEY, MESSAGE))


def test_a_member_told_another_relays_key_names_its_relay_once() -> None:
    # A shared port: the sibling of the member's relay answered first.
    dialer = DialerHandshake(lambda challenge: HELLO, expect=("relay-b", KEY))
    assert dialer.receive(Challenge(b"s" * 32, b"n" * 32)) == Route("relay-b")
    assert not dialer.established and dialer.routed
    # Handed on, its relay challenges it with its own key.
    assert dialer.receive(Challenge(KEY, b"m" * 32)) == HELLO
    # Its relay's key, first time: no detour.
    direct = DialerHandshake(lambda challenge: HELLO, expect=("relay-b", KEY))
    assert direct.receive(Challenge(KEY, b"n" * 32)) == HELLO and not direct.routed
    # Another key again after the Route (the relay restarted with a new key): it answers.
    stale = DialerHandshake(lambda challenge: HELLO, expect=("relay-b", KEY))
    stale.receive(Challenge(b"s" * 32, b"n" * 32))
    assert stale.receive(Challenge(b"t" * 32, b"n" * 32)) == HELLO
    # The sibling could not hand it on: a refusal, not a protocol error.
    lost = DialerHandshake(lambda challenge: HELLO, expect=("relay-z", KEY))
    lost.receive(Challenge(b"s" * 32, b"n" * 32))
    with pytest.raises(HandshakeRefused, match="NoSuchRelay"):
        lost.receive(ErrorFrame("NoSuchRelay", "no relay named 'relay-z'"))


def test_the_acceptor_takes_a_route_once_per_connection() -> None:
    acceptor = AcceptorHandshake(KEY)
    acceptor.receive(Route("relay-b"))
    assert acceptor.established and acceptor.route == "relay-b" and acceptor.hello is None
    with pytest.raises(FrameError, match="expected hello, got Route"):
        AcceptorHandshake(KEY, routed=True).receive(Route("relay-c"))


async def test_welcome_and_a_forwarded_frame_in_one_read_both_arrive() -> None:
    """The race of issue 9 (3): a relay writes Welcome and the first Recv in one segment."""

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(encode(Challenge(KEY, b"n" * 32)))
        await reader.read(1000)  # the hello
        writer.write(encode(Welcome("relay-0", "eu", 0)) + encode(Recv(KEY, MESSAGE)))
        await writer.drain()
        await reader.read(1000)
        writer.close()

    server = await asyncio.start_server(relay, "127.0.0.1", 0)
    async with server:
        conn = await open_connection(*server.sockets[0].getsockname()[:2])
        welcome = await conn.dial(lambda challenge: HELLO)
        assert welcome.relay == "relay-0"
        assert await conn.read_frames() == [Recv(KEY, MESSAGE)]
        conn.close()


async def test_writes_to_a_closed_connection_report_it_instead_of_raising() -> None:
    async def peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.transport.abort()

    server = await asyncio.start_server(peer, "127.0.0.1", 0)
    async with server:
        conn = await open_connection(*server.sockets[0].getsockname()[:2])
        assert conn.transport is not None
        conn.transport.abort()
        assert conn.send_nowait(Recv(KEY, MESSAGE)) is False
        assert (await conn.send(Recv(KEY, MESSAGE))) is False
        assert conn.offer_all([encode(Recv(KEY, MESSAGE))], 1 << 20).value == "destination_closed"

"""Property tests (S3): malformed greetings and requests, in any split, never crash the codec;
each ends in a reply code or a clean close, and well-formed input always round-trips."""

from __future__ import annotations

import errno
import ipaddress
import socket

from hypothesis import given, settings
from hypothesis import strategies as st

from libs.socks5 import (
    ConnectRequest,
    Rejected,
    ReplyCode,
    ServerCodec,
    SocksError,
    State,
    client_connect,
    client_greeting,
    parse_reply,
)
from libs.socks5.server import SocksRefusal, reply_for_exception

VALID_METHOD_REPLIES = {b"", b"\x05\x00", b"\x05\xff", b"\x05\x00" + b"", b"\x00\x5b" + bytes(6)}


def chunks(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    pieces, start = [], 0
    for point in [*points, len(data)]:
        pieces.append(data[start:point])
        start = point
    return pieces


def feed(codec: ServerCodec, pieces: list[bytes]) -> tuple[list[ConnectRequest | Rejected], bytes]:
    events: list[ConnectRequest | Rejected] = []
    out = b""
    for piece in pieces:
        event = codec.receive_data(piece)
        out += codec.data_to_send()
        if event is not None:
            events.append(event)
    return events, out


def check_output(events: list[ConnectRequest | Rejected], out: bytes, codec: ServerCodec) -> None:
    """At most one event; whatever was sent is a well-formed answer."""
    assert len(events) <= 1
    if events and isinstance(events[0], Rejected):
        assert codec.state is State.CLOSED
        rejected = events[0]
        if rejected.reply is not None:
            # greeting accepted (05 00), then a full reply carrying that code
            assert out[:2] == b"\x05\x00"
            parsed = parse_reply(out[2:])
            assert parsed is not None and parsed.code == rejected.reply
            assert parsed.size == len(out) - 2
        else:
            assert out in VALID_METHOD_REPLIES
    elif events:
        assert codec.state is State.DIALING
        assert out == b"\x05\x00"
    else:
        assert out in (b"", b"\x05\x00")


@settings(max_examples=500)
@given(st.binary(max_size=600), st.lists(st.integers(min_value=0), max_size=8))
def test_arbitrary_bytes_never_crash(data: bytes, cuts: list[int]) -> None:
    codec = ServerCodec()
    events, out = feed(codec, chunks(data, cuts))
    check_output(events, out, codec)


@settings(max_examples=500)
@given(
    st.binary(min_size=1, max_size=20),
    st.integers(min_value=0, max_value=255),
    st.integers(min_value=0, max_value=255),
    st.integers(min_value=0, max_value=255),
    st.integers(min_value=0, max_value=255),
    st.binary(max_size=300),
    st.lists(st.integers(min_value=0), max_size=6),
)
def test_malformed_requests_get_a_reply_code(
    methods: bytes,
    version: int,
    command: int,
    reserved: int,
    atyp: int,
    rest: bytes,
    cuts: list[int],
) -> None:
    codec = ServerCodec()
    stream = client_greeting(methods) + bytes([version, command, reserved, atyp]) + rest
    events, out = feed(codec, chunks(stream, cuts))
    check_output(events, out, codec)
    if 0 not in methods:
        assert out == b"\x05\xff"
    elif events and isinstance(events[0], Rejected):
        assert events[0].reply is not None and events[0].reply != ReplyCode.SUCCEEDED


hosts = st.one_of(
    st.ip_addresses().map(str),
    st.from_regex(r"[a-z0-9][a-z0-9-]{0,20}(\.[a-z0-9][a-z0-9-]{0,20}){0,3}", fullmatch=True),
)


@settings(max_examples=300)
@given(
    hosts,
    st.integers(min_value=0, max_value=65535),
    st.binary(max_size=64),
    st.lists(st.integers(min_value=0), max_size=6),
)
def test_well_formed_requests_round_trip(
    host: str, port: int, early: bytes, cuts: list[int]
) -> None:
    codec = ServerCodec()
    events, out = feed(codec, chunks(client_greeting() + client_connect(host, port) + early, cuts))
    assert out == b"\x05\x00"
    assert len(events) == 1 and isinstance(events[0], ConnectRequest)
    expected = host
    try:
        expected = str(ipaddress.ip_address(host))
    except ValueError:
        pass
    assert (events[0].host, events[0].port) == (expected, port)
    codec.accept()
    assert codec.take_early_data() == early


@settings(max_examples=300)
@given(st.binary(max_size=300))
def test_a_client_parsing_any_reply_gets_a_reply_none_or_socks_error(data: bytes) -> None:
    try:
        parsed = parse_reply(data)
    except SocksError:
        return
    assert parsed is None or 0 < parsed.size <= len(data)


@given(st.integers(min_value=-200, max_value=300))
def test_every_oserror_maps_to_a_reply(code: int) -> None:
    reply = reply_for_exception(OSError(code, "x"))
    assert isinstance(reply, ReplyCode) and reply != ReplyCode.SUCCEEDED


def test_exception_mapping() -> None:
    assert reply_for_exception(ConnectionRefusedError()) == ReplyCode.CONNECTION_REFUSED
    assert reply_for_exception(TimeoutError()) == ReplyCode.TTL_EXPIRED
    assert reply_for_exception(OSError(errno.ETIMEDOUT, "t")) == ReplyCode.TTL_EXPIRED
    assert reply_for_exception(OSError(errno.EHOSTUNREACH, "h")) == ReplyCode.HOST_UNREACHABLE
    assert reply_for_exception(OSError(errno.ENETUNREACH, "n")) == ReplyCode.NETWORK_UNREACHABLE
    assert reply_for_exception(OSError(errno.EACCES, "a")) == ReplyCode.NOT_ALLOWED
    assert (
        reply_for_exception(OSError(errno.EAFNOSUPPORT, "f"))
        == ReplyCode.ADDRESS_TYPE_NOT_SUPPORTED
    )
    assert reply_for_exception(socket.gaierror(-2, "unknown")) == ReplyCode.HOST_UNREACHABLE
    assert reply_for_exception(SocksRefusal()) == ReplyCode.NOT_ALLOWED
    assert (
        reply_for_exception(SocksRefusal(ReplyCode.HOST_UNREACHABLE)) == ReplyCode.HOST_UNREACHABLE
    )
    assert reply_for_exception(ValueError("bug")) == ReplyCode.GENERAL_FAILURE

"""The SOCKS5 server codec, input by input: what it answers and what it hands back."""

from __future__ import annotations

import pytest

from libs.socks5 import (
    AddressType,
    ConnectRequest,
    Rejected,
    ReplyCode,
    ServerCodec,
    SocksError,
    State,
    client_connect,
    client_greeting,
    parse_method_selection,
    parse_reply,
)

GREETING = client_greeting()
FAILURE_TAIL = b"\x00\x01\x00\x00\x00\x00\x00\x00"  # RSV ATYP=1 0.0.0.0:0


def state(codec: ServerCodec) -> State:
    return codec.state  # read afresh: each call may have moved it on


def reply(code: ReplyCode) -> bytes:
    return bytes([5, code]) + FAILURE_TAIL


@pytest.mark.parametrize(
    ("host", "port", "atyp"),
    [
        ("127.0.0.2", 29500, AddressType.IPV4),
        ("fd00::2", 443, AddressType.IPV6),
        ("rank-1.gang.internal", 8080, AddressType.DOMAIN),
    ],
)
def test_connect_request_for_each_address_type(host: str, port: int, atyp: AddressType) -> None:
    codec = ServerCodec()
    assert codec.receive_data(GREETING) is None
    assert codec.data_to_send() == b"\x05\x00"  # no authentication
    assert state(codec) is State.REQUEST
    event = codec.receive_data(client_connect(host, port))
    assert event == ConnectRequest(host, port, atyp)
    assert state(codec) is State.DIALING
    codec.accept("127.0.0.1", 40000)
    assert state(codec) is State.ESTABLISHED
    sent = codec.data_to_send()
    parsed = parse_reply(sent)
    assert parsed is not None and parsed.succeeded
    assert (parsed.host, parsed.port, parsed.size) == ("127.0.0.1", 40000, len(sent))


def test_pipelined_greeting_request_and_early_data_one_byte_at_a_time() -> None:
    codec = ServerCodec()
    stream = GREETING + client_connect("10.0.0.7", 22) + b"SSH-2.0-early"
    events = [codec.receive_data(stream[i : i + 1]) for i in range(len(stream))]
    requests = [e for e in events if e is not None]
    assert requests == [ConnectRequest("10.0.0.7", 22, AddressType.IPV4)]
    codec.accept()
    assert codec.take_early_data() == b"SSH-2.0-early"
    assert codec.take_early_data() == b""


def test_refusal_queues_the_reply_and_closes() -> None:
    codec = ServerCodec()
    codec.receive_data(GREETING + client_connect("10.0.0.7", 22) + b"lost")
    codec.data_to_send()
    codec.refuse(ReplyCode.CONNECTION_REFUSED)
    assert codec.data_to_send() == reply(ReplyCode.CONNECTION_REFUSED)
    assert state(codec) is State.CLOSED
    assert codec.take_early_data() == b""
    assert codec.receive_data(b"anything") is None  # ignored once closed


@pytest.mark.parametrize(
    ("data", "answer", "code", "reason"),
    [
        (b"\x04\x01\x00\x50\x7f\x00\x00\x01\x00", b"\x00\x5b" + b"\x00" * 6, None, "SOCKS4"),
        (b"GET / HTTP/1.1\r\n", b"", None, "not SOCKS"),
        (b"\x05\x00", b"\x05\xff", None, "no acceptable method"),
        (b"\x05\x02\x02\x01", b"\x05\xff", None, "offered 0x02, 0x01"),
    ],
)
def test_bad_greetings(data: bytes, answer: bytes, code: ReplyCode | None, reason: str) -> None:
    codec = ServerCodec()
    event = codec.receive_data(data)
    assert isinstance(event, Rejected)
    assert reason in event.reason
    assert event.reply is code
    assert codec.data_to_send() == answer
    assert state(codec) is State.CLOSED


@pytest.mark.parametrize(
    ("request_bytes", "code", "reason"),
    [
        (b"\x04\x01\x00\x01\x7f\x00\x00\x01\x00\x50", ReplyCode.GENERAL_FAILURE, "version 4"),
        (b"\x05\x02\x00\x01\x7f\x00\x00\x01\x00\x50", ReplyCode.COMMAND_NOT_SUPPORTED, "BIND"),
        (b"\x05\x03\x00\x01\x7f\x00\x00\x01\x00\x50", ReplyCode.COMMAND_NOT_SUPPORTED, "UDP"),
        (b"\x05\x09\x00\x01", ReplyCode.COMMAND_NOT_SUPPORTED, "0x09"),
        (b"\x05\x01\x07\x01\x7f\x00\x00\x01\x00\x50", ReplyCode.GENERAL_FAILURE, "reserved"),
        (b"\x05\x01\x00\x02", ReplyCode.ADDRESS_TYPE_NOT_SUPPORTED, "address type 0x02"),
        (b"\x05\x01\x00\x03\x00\x00\x50", ReplyCode.GENERAL_FAILURE, "empty domain"),
        (b"\x05\x01\x00\x03\x03a b\x00\x50", ReplyCode.GENERAL_FAILURE, "invalid domain"),
        (b"\x05\x01\x00\x03\x02\xc3\xa9\x00\x50", ReplyCode.GENERAL_FAILURE, "invalid domain"),
    ],
)
def test_bad_requests_get_their_reply_code(
    request_bytes: bytes, code: ReplyCode, reason: str
) -> None:
    codec = ServerCodec()
    codec.receive_data(GREETING)
    codec.data_to_send()
    event = codec.receive_data(request_bytes)
    assert isinstance(event, Rejected)
    assert event.reply is code
    assert reason in event.reason
    assert codec.data_to_send() == reply(code)


def test_misuse_by_the_server_code_is_an_error_not_a_reply() -> None:
    codec = ServerCodec()
    with pytest.raises(RuntimeError):
        codec.accept()
    codec.receive_data(GREETING + client_connect("10.0.0.1", 1))
    with pytest.raises(ValueError):
        codec.refuse(ReplyCode.SUCCEEDED)


def test_client_helpers() -> None:
    assert parse_method_selection(b"\x05") is None
    assert parse_method_selection(b"\x05\x00") == 0
    with pytest.raises(SocksError):
        parse_method_selection(b"\x04\x00")
    full = bytes([5, 0, 0, 3, 4]) + b"host" + b"\x01\xbb"
    assert parse_reply(full[:-1]) is None
    parsed = parse_reply(full + b"payload")
    assert parsed is not None and (parsed.host, parsed.port, parsed.size) == ("host", 443, 11)
    with pytest.raises(SocksError):
        parse_reply(b"\x05\x00\x00\x09")
    with pytest.raises(SocksError):
        client_connect("x" * 256, 1)

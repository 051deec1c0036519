"""The asyncio SOCKS5 server on real sockets: dial outcomes become reply codes, bytes are
spliced both ways intact with half-closes and backpressure, bad clients are dropped cleanly."""

from __future__ import annotations

import asyncio
import errno
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from libs.socks5 import ReplyCode, client_connect, client_greeting, parse_reply
from libs.socks5.server import (
    Dial,
    SocksClosed,
    SocksConnected,
    SocksEvent,
    SocksRefusal,
    SocksRejected,
    Streams,
    open_connection_dial,
    serve,
)

pytestmark = pytest.mark.timeout(60)


class Endpoint:
    def __init__(self, server: asyncio.Server, events: list[SocksEvent]) -> None:
        self.server = server
        self.events = events
        self.port: int = server.sockets[0].getsockname()[1]

    async def open(
        self, host: str, port: int
    ) -> tuple[int, asyncio.StreamReader, asyncio.StreamWriter]:
        """Connects through the endpoint; returns the reply code and the streams."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        writer.write(client_greeting() + client_connect(host, port))
        assert await reader.readexactly(2) == b"\x05\x00"
        head = await reader.readexactly(4)
        rest = await reader.readexactly({1: 6, 4: 18}[head[3]])
        reply = parse_reply(head + rest)
        assert reply is not None
        return reply.code, reader, writer


StartEndpoint = Callable[..., Awaitable[Endpoint]]


@pytest.fixture
async def endpoint() -> AsyncIterator[StartEndpoint]:
    servers: list[asyncio.Server] = []

    async def start(dial: Dial = open_connection_dial, **kwargs: float) -> Endpoint:
        events: list[SocksEvent] = []
        server = await serve("127.0.0.1", 0, dial, on_event=events.append, **kwargs)
        servers.append(server)
        return Endpoint(server, events)

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()


async def wait_for_event(events: list[SocksEvent], kind: type, timeout: float = 5.0) -> SocksEvent:
    async with asyncio.timeout(timeout):
        while True:
            for event in events:
                if isinstance(event, kind):
                    return event
            await asyncio.sleep(0.01)


async def echo_server() -> tuple[asyncio.Server, int]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.write_eof()  # answer the half-close with ours
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.2", 0)
    return server, server.sockets[0].getsockname()[1]


async def test_connect_splices_both_ways_with_half_close(endpoint: StartEndpoint) -> None:
    ep = await endpoint()
    server, port = await echo_server()
    async with server:
        code, reader, writer = await ep.open("127.0.0.2", port)
        assert code == ReplyCode.SUCCEEDED
        payload = os.urandom(4 * 1024 * 1024)

        async def send() -> None:
            writer.write(payload)
            await writer.drain()
            writer.write_eof()

        sending = asyncio.create_task(send())
        received = await reader.read(-1)  # until the echo's EOF came back through
        await sending
        assert received == payload
        writer.close()
        closed = await wait_for_event(ep.events, SocksClosed)
    assert isinstance(closed, SocksClosed)
    assert (closed.bytes_up, closed.bytes_down) == (len(payload), len(payload))
    connected = ep.events[0]
    assert isinstance(connected, SocksConnected) and connected.reply == 0 and connected.via


async def test_early_data_is_forwarded(endpoint: StartEndpoint) -> None:
    ep = await endpoint()
    server, port = await echo_server()
    async with server:
        reader, writer = await asyncio.open_connection("127.0.0.1", ep.port)
        writer.write(client_greeting() + client_connect("127.0.0.2", port) + b"optimistic")
        data = await reader.readexactly(2 + 10 + 10)
        assert data[:3] == b"\x05\x00\x05" and data[3] == 0
        assert data[12:] == b"optimistic"
        writer.close()


@pytest.mark.parametrize(
    ("raised", "code"),
    [
        (ConnectionRefusedError(errno.ECONNREFUSED, "refused"), ReplyCode.CONNECTION_REFUSED),
        (OSError(errno.EHOSTUNREACH, "no route to host"), ReplyCode.HOST_UNREACHABLE),
        (OSError(errno.ENETUNREACH, "network unreachable"), ReplyCode.NETWORK_UNREACHABLE),
        (TimeoutError(), ReplyCode.TTL_EXPIRED),
        (SocksRefusal(), ReplyCode.NOT_ALLOWED),
        (SocksRefusal(ReplyCode.HOST_UNREACHABLE, "not in this gang"), ReplyCode.HOST_UNREACHABLE),
        (RuntimeError("a bug in dial"), ReplyCode.GENERAL_FAILURE),
    ],
)
async def test_dial_exceptions_become_replies(
    endpoint: StartEndpoint, raised: Exception, code: ReplyCode
) -> None:
    async def dial(host: str, port: int) -> Streams:
        raise raised

    ep = await endpoint(dial)
    got, reader, writer = await ep.open("10.1.2.3", 80)
    assert got == code
    assert await reader.read() == b""  # and the endpoint closes
    writer.close()
    event = ep.events[-1]
    assert isinstance(event, SocksConnected) and event.reply == code and event.error


async def test_real_refusal_and_dial_timeout(endpoint: StartEndpoint) -> None:
    ep = await endpoint()
    with socket.socket() as probe:
        probe.bind(("127.0.0.2", 0))
        closed_port = probe.getsockname()[1]
    code, _, writer = await ep.open("127.0.0.2", closed_port)
    assert code == ReplyCode.CONNECTION_REFUSED
    writer.close()

    async def slow(host: str, port: int) -> Streams:
        await asyncio.sleep(30)
        raise AssertionError("not reached")

    ep = await endpoint(slow, dial_timeout=0.2)
    code, _, writer = await ep.open("127.0.0.2", 1)
    assert code == ReplyCode.TTL_EXPIRED
    writer.close()


@pytest.mark.parametrize(
    ("data", "answer", "reason"),
    [
        (b"\x05\x01\x02", b"\x05\xff", "no acceptable method"),
        (b"\x04\x01\x00\x50\x7f\x00\x00\x01\x00", b"\x00\x5b" + bytes(6), "SOCKS4"),
        (b"GET / HTTP/1.1\r\n\r\n", b"", "not SOCKS"),
        (
            client_greeting() + b"\x05\x02\x00\x01\x7f\x00\x00\x01\x00\x50",
            b"\x05\x00\x05\x07",
            "BIND",
        ),
        (b"\x05\x01", b"", "closed during the handshake"),
    ],
)
async def test_bad_clients_get_their_answer_and_are_closed(
    endpoint: StartEndpoint, data: bytes, answer: bytes, reason: str
) -> None:
    ep = await endpoint()
    reader, writer = await asyncio.open_connection("127.0.0.1", ep.port)
    writer.write(data)
    if reason == "closed during the handshake":
        writer.write_eof()
    got = await reader.read()  # everything until the endpoint closes
    assert got.startswith(answer)
    writer.close()
    event = await wait_for_event(ep.events, SocksRejected)
    assert isinstance(event, SocksRejected) and reason in event.reason


async def test_silent_client_is_dropped_after_the_handshake_timeout(
    endpoint: StartEndpoint,
) -> None:
    ep = await endpoint(handshake_timeout=0.2)
    reader, writer = await asyncio.open_connection("127.0.0.1", ep.port)
    assert await asyncio.wait_for(reader.read(), 5) == b""
    writer.close()
    event = await wait_for_event(ep.events, SocksRejected)
    assert isinstance(event, SocksRejected) and "no request within" in event.reason


async def test_backpressure_bounds_what_the_endpoint_buffers(endpoint: StartEndpoint) -> None:
    """A destination that does not read: the client soon cannot write any more, instead of
    the endpoint reading everything into memory."""
    stalled: list[asyncio.StreamWriter] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        stalled.append(writer)  # never reads

    server = await asyncio.start_server(handle, "127.0.0.2", 0)
    port = server.sockets[0].getsockname()[1]
    ep = await endpoint()
    async with server:
        code, _, writer = await ep.open("127.0.0.2", port)
        assert code == 0
        sock = writer.get_extra_info("socket")
        raw = socket.socket(fileno=os.dup(sock.fileno()))
        raw.setblocking(False)
        chunk = bytes(1 << 20)
        sent = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 3
        while loop.time() < deadline and sent < 512 << 20:
            try:
                sent += raw.send(chunk)
            except BlockingIOError:
                await asyncio.sleep(0.05)
        raw.close()
        writer.close()
        for w in stalled:
            w.close()
    # Kernel buffers on three sockets plus the splice's own: tens of MiB at most.
    assert sent < 96 << 20, f"{sent >> 20} MiB went in: no backpressure"

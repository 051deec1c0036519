"""A thin asyncio SOCKS5 server around `ServerCodec`: `serve(host, port, dial)`.

`dial(host, port)` opens the connection to the destination and returns asyncio streams; it
is the only policy: a dial refuses what it will not reach with `raise SocksRefusal()`, tests
pass `open_connection`. (The agent's entry splices into the gang's tunnel, not into streams:
it runs the same codec on a protocol of its own, services/agent/relayed/socks.py.) Whatever
it raises becomes the reply the client is owed (`reply_for_exception`), so the shim in front
turns it back into the errno a direct connect would have given:

    ConnectionRefusedError                    -> 5 connection refused
    TimeoutError (incl. OSError ETIMEDOUT,     -> 6 TTL expired
      and dial_timeout running out)
    OSError ENETUNREACH, ENETDOWN             -> 3 network unreachable
    OSError EHOSTUNREACH, EHOSTDOWN,          -> 4 host unreachable
      socket.gaierror (name not resolved)
    OSError EACCES, EPERM; SocksRefusal()     -> 2 not allowed by ruleset
    OSError EAFNOSUPPORT                      -> 8 address type not supported
    SocksRefusal(code)                        -> code
    anything else                             -> 1 general failure (logged)

Once connected, bytes are spliced both ways with backpressure (each direction reads only
after the other side has drained what it wrote) and half-closes are passed on. Nothing a
client sends can raise out of a connection's handler (S3); every connection ends with an
event for `on_event`: SocksConnected (with the reply, also for failures), SocksClosed (bytes
each way), or SocksRejected (malformed input, handshake timeout).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import socket
from collections.abc import Awaitable, Callable

from libs.contracts.socks import SocksClosed, SocksConnected, SocksEvent, SocksRejected
from libs.runtime.streams import close_stream
from libs.runtime.tasks import TaskSet
from libs.socks5.codec import ConnectRequest, Rejected, ReplyCode, ServerCodec

__all__ = [
    "Dial",
    "SocksClosed",
    "SocksConnected",
    "SocksEvent",
    "SocksRefusal",
    "SocksRejected",
    "open_connection_dial",
    "read_request",
    "reply_for_exception",
    "serve",
    "splice",
]

log = logging.getLogger("nodus.socks5")

Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]
Dial = Callable[[str, int], Awaitable[Streams]]

BUFFER = 256 * 1024


class SocksRefusal(Exception):
    """Raised by a dial function that will not connect there: the client gets `code`
    (default 2, not allowed by ruleset)."""

    def __init__(self, code: ReplyCode = ReplyCode.NOT_ALLOWED, reason: str = "") -> None:
        super().__init__(reason or code.name.lower().replace("_", " "))
        self.code = code


_NETWORK = {errno.ENETUNREACH, errno.ENETDOWN}
_HOST = {errno.EHOSTUNREACH, errno.EHOSTDOWN}
_NOT_ALLOWED = {errno.EACCES, errno.EPERM}


def reply_for_exception(exc: BaseException) -> ReplyCode:
    """The SOCKS5 reply for what a dial raised."""
    if isinstance(exc, SocksRefusal):
        return exc.code
    if isinstance(exc, ConnectionRefusedError):
        return ReplyCode.CONNECTION_REFUSED
    if isinstance(exc, TimeoutError):
        return ReplyCode.TTL_EXPIRED
    if isinstance(exc, socket.gaierror):
        return ReplyCode.HOST_UNREACHABLE
    if isinstance(exc, OSError):
        if exc.errno in _NETWORK:
            return ReplyCode.NETWORK_UNREACHABLE
        if exc.errno in _HOST:
            return ReplyCode.HOST_UNREACHABLE
        if exc.errno in _NOT_ALLOWED:
            return ReplyCode.NOT_ALLOWED
        if exc.errno == errno.EAFNOSUPPORT:
            return ReplyCode.ADDRESS_TYPE_NOT_SUPPORTED
    return ReplyCode.GENERAL_FAILURE


async def read_request(
    codec: ServerCodec, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> ConnectRequest | Rejected | None:
    """The SOCKS5 handshake, greeting to request, answering as the codec says: the CONNECT
    request, the codec's refusal (its reply already written), or None when the client closed
    first. Callers bound it with their handshake timeout."""
    while True:
        data = await reader.read(4096)
        event = codec.receive_data(data) if data else None
        if out := codec.data_to_send():
            writer.write(out)
            await writer.drain()
        if isinstance(event, Rejected | ConnectRequest):
            return event
        if not data:
            return None


async def open_connection_dial(host: str, port: int) -> Streams:
    """Dial directly (the default, and what tests use)."""
    return await asyncio.open_connection(host, port, limit=BUFFER)


def _address(info: object) -> str:
    if isinstance(info, tuple) and len(info) >= 2:
        host = str(info[0])
        return f"[{host}]:{info[1]}" if ":" in host else f"{host}:{info[1]}"
    return str(info)


class _Count:
    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


async def _pump(
    src: asyncio.StreamReader,
    dst: asyncio.StreamWriter,
    other: asyncio.StreamWriter,
    count: _Count,
    size: int,
) -> None:
    try:
        while data := await src.read(size):
            dst.write(data)
            count.n += len(data)
            await dst.drain()  # backpressure: no more reads until the other side took it
        if not dst.is_closing() and dst.can_write_eof():
            dst.write_eof()  # pass the half-close on; the other direction keeps going
    except (ConnectionError, OSError, RuntimeError):
        # One side broke: end both, so the other direction stops too.
        dst.transport.abort()
        other.transport.abort()


async def splice(
    a_reader: asyncio.StreamReader,
    a_writer: asyncio.StreamWriter,
    b_reader: asyncio.StreamReader,
    b_writer: asyncio.StreamWriter,
    size: int = BUFFER,
) -> tuple[int, int]:
    """Copies a -> b and b -> a until both directions end; returns (a->b, b->a) bytes."""
    up, down = _Count(), _Count()
    await asyncio.gather(
        _pump(a_reader, b_writer, a_writer, up, size),
        _pump(b_reader, a_writer, b_writer, down, size),
    )
    return up.n, down.n


class _Handler:
    def __init__(
        self,
        dial: Dial,
        dial_timeout: float,
        handshake_timeout: float,
        on_event: Callable[[SocksEvent], None] | None,
    ) -> None:
        self.dial = dial
        self.dial_timeout = dial_timeout
        self.handshake_timeout = handshake_timeout
        self.on_event = on_event
        # Strong references to the connections being served: the event loop holds tasks only
        # weakly, and with uvloop a connection waiting on both half-closed sockets was
        # otherwise collected mid-splice ("Task was destroyed but it is pending").
        self.live = TaskSet("socks5 connection", log)

    def emit(self, event: SocksEvent) -> None:
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:
                log.exception("socks5 on_event callback failed")

    async def __call__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        client = _address(writer.get_extra_info("peername"))
        try:
            await self._connection(client, reader, writer)
        except asyncio.CancelledError:
            raise
        except (ConnectionError, OSError):
            pass  # the client went away
        except Exception:
            log.exception("socks5 connection from %s failed", client)
        finally:
            writer.close()  # no await in finally: the task may be torn down at shutdown

    async def _handshake(
        self, client: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[ServerCodec, ConnectRequest] | None:
        codec = ServerCodec()
        try:
            async with asyncio.timeout(self.handshake_timeout):
                event = await read_request(codec, reader, writer)
            if isinstance(event, Rejected):
                self.emit(SocksRejected(client, event.reason, event.reply))
                return None
            if event is None:
                self.emit(SocksRejected(client, "closed during the handshake"))
                return None
            return codec, event
        except TimeoutError:
            self.emit(SocksRejected(client, f"no request within {self.handshake_timeout:g}s"))
            return None

    async def _connection(
        self, client: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        shaken = await self._handshake(client, reader, writer)
        if shaken is None:
            return
        codec, request = shaken
        try:
            async with asyncio.timeout(self.dial_timeout):
                target_reader, target = await self.dial(request.host, request.port)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            code = reply_for_exception(exc)
            if code == ReplyCode.GENERAL_FAILURE and not isinstance(exc, OSError):
                log.warning("socks5 dial %s:%s failed: %r", request.host, request.port, exc)
            codec.refuse(code)
            writer.write(codec.data_to_send())
            await writer.drain()
            error = str(exc) or type(exc).__name__
            self.emit(SocksConnected(client, request.host, request.port, code, error=error))
            return

        bound = target.get_extra_info("sockname")
        host, port = (str(bound[0]), int(bound[1])) if isinstance(bound, tuple) else ("0.0.0.0", 0)
        codec.accept(host, port)
        writer.write(codec.data_to_send())
        early = codec.take_early_data()
        if early:
            target.write(early)
        self.emit(SocksConnected(client, request.host, request.port, 0, via=_address(bound)))
        try:
            up, down = await splice(reader, writer, target_reader, target)
        finally:
            target.close()
        self.emit(SocksClosed(client, request.host, request.port, up + len(early), down))
        await close_stream(target)


async def serve(
    host: str,
    port: int,
    dial: Dial = open_connection_dial,
    *,
    dial_timeout: float = 20.0,
    handshake_timeout: float = 10.0,
    on_event: Callable[[SocksEvent], None] | None = None,
) -> asyncio.Server:
    """Starts a SOCKS5 server on host:port (port 0: any) and returns it, listening.

    dial_timeout bounds each dial (reply 6 when it runs out; keep it below the shim's
    NODUS_NETSHIM_TIMEOUT_MS, 30 s by default, so the shim gets an answer);
    handshake_timeout bounds greeting + request from a client.
    """
    handler = _Handler(dial, dial_timeout, handshake_timeout, on_event)
    return await asyncio.start_server(
        lambda reader, writer: handler.live.spawn(handler(reader, writer)),
        host,
        port,
        limit=BUFFER,
        reuse_address=True,
    )

"""The local control channel between the agent and an epoch's dataplane process: a unix socket
in the epoch's state directory (mode 0700, the agent's), one request and one reply per
connection, each a 4-byte big-endian length and msgspec JSON.

The framing is sans-I/O (`frame`, `FrameBuffer`); the asyncio server and the two clients
(asyncio for the agent's loop, blocking for the /metrics thread) are thin around it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import msgspec

from libs.contracts.dataplane import ControlReply, ControlRequest
from libs.contracts.errors import ErrorCode, NodusError
from libs.runtime.streams import close_stream
from libs.runtime.tasks import TaskSet, handled_by

log = logging.getLogger("nodus.agent.dataplane.control")

SOCKET = "control.sock"
MAX_FRAME = 16 << 20
_HEADER = struct.Struct(">I")
_LONGEST_PATH = 100  # sun_path holds 108 bytes; deep state directories do not fit

_requests = msgspec.json.Decoder(ControlRequest)
_replies = msgspec.json.Decoder(ControlReply)
_encoder = msgspec.json.Encoder()


def frame(message: ControlRequest | ControlReply) -> bytes:
    data = _encoder.encode(message)
    return _HEADER.pack(len(data)) + data


class FrameBuffer:
    """Bytes in, whole frame bodies out; a frame longer than MAX_FRAME is an error (S3)."""

    def __init__(self) -> None:
        self._data = bytearray()

    def feed(self, data: bytes) -> bytes | None:
        self._data += data
        if len(self._data) < _HEADER.size:
            return None
        (length,) = _HEADER.unpack_from(self._data)
        if length > MAX_FRAME:
            raise ValueError(f"a control frame of {length} bytes")
        if len(self._data) < _HEADER.size + length:
            return None
        return bytes(self._data[_HEADER.size : _HEADER.size + length])


def decode_request(body: bytes) -> ControlRequest:
    return _requests.decode(body)


def decode_reply(body: bytes) -> ControlReply:
    return _replies.decode(body)


@contextlib.contextmanager
def reachable(path: Path) -> Iterator[str]:
    """A name for `path` that fits a unix socket address: itself, or the same file reached
    through an open descriptor of its directory (/proc/self/fd/N/name)."""
    name = str(path)
    if len(name.encode()) <= _LONGEST_PATH:
        yield name
        return
    fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY)
    try:
        yield f"/proc/self/fd/{fd}/{path.name}"
    finally:
        os.close(fd)


Handler = Callable[[ControlRequest], Awaitable[ControlReply]]


def _listen(path: Path) -> socket.socket:
    path.unlink(missing_ok=True)  # one left by a process before
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with reachable(path) as name:
        listener.bind(name)
    os.chmod(path, 0o600)
    listener.listen(16)
    listener.setblocking(False)
    return listener


async def serve(path: Path, handler: Handler) -> asyncio.AbstractServer:
    """Answer requests on the socket at `path`."""
    listener = _listen(path)

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        buffer = FrameBuffer()
        try:
            body = None
            while body is None:
                data = await asyncio.wait_for(reader.read(65536), 10.0)
                if not data:
                    return
                body = buffer.feed(data)
            try:
                reply = await handler(decode_request(body))
            except NodusError as error:
                reply = ControlReply(ok=False, error=str(error))
            writer.write(frame(reply))
            await writer.drain()
        except (ValueError, msgspec.DecodeError) as error:  # S3: said, and dropped
            log.warning("a malformed control request: %s", error)
        except (TimeoutError, ConnectionError):
            pass
        finally:
            await close_stream(writer)

    return await asyncio.start_unix_server(
        handled_by(TaskSet("control request", log), answer), sock=listener
    )


def _refused(path: Path, error: BaseException) -> NodusError:
    return NodusError(
        ErrorCode.NO_RESPONDERS, f"the dataplane's control socket {path} does not answer: {error!r}"
    )


async def request(path: Path, message: ControlRequest, timeout: float = 5.0) -> ControlReply:
    """One exchange with the dataplane at `path`; NodusError if it does not answer in time."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        async with asyncio.timeout(timeout):
            with reachable(path) as name:
                await asyncio.get_running_loop().sock_connect(sock, name)
            reader, writer = await asyncio.open_unix_connection(sock=sock)
            try:
                writer.write(frame(message))
                await writer.drain()
                buffer = FrameBuffer()
                body = None
                while body is None:
                    data = await reader.read(65536)
                    if not data:
                        raise ConnectionError("closed before answering")
                    body = buffer.feed(data)
            finally:
                await close_stream(writer)
    except (OSError, TimeoutError, ValueError) as error:
        sock.close()
        raise _refused(path, error) from None
    reply = decode_reply(body)
    if not reply.ok:
        raise NodusError(ErrorCode.INTERNAL, reply.error)
    return reply


def request_blocking(path: Path, message: ControlRequest, timeout: float = 2.0) -> ControlReply:
    """The same from a thread without a loop (prometheus-client's /metrics server)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            with reachable(path) as name:
                sock.connect(name)
            sock.sendall(frame(message))
            buffer = FrameBuffer()
            body = None
            while body is None:
                data = sock.recv(65536)
                if not data:
                    raise ConnectionError("closed before answering")
                body = buffer.feed(data)
        except (OSError, ValueError) as error:
            raise _refused(path, error) from None
    return decode_reply(body)

"""A framed TCP connection for relays and their clients: the thin asyncio shell around the
frame codec and the handshake.

Writing never raises: a connection that closed under us reports it (`send_nowait` and
`offer_all` return False or a reason) and the caller decides what that failure owns: a relay
drops what was meant for that destination, a member fails over. Two ways to write:
  - `send` waits for the peer to take its bytes when too many are queued (backpressure on
    whoever is sending), for traffic the writer itself produces;
  - `offer_all` never waits: what a full destination cannot take is refused, so the loop that
    forwards it (another member's session, a mesh link shared by many gangs) keeps going.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from enum import Enum
from typing import cast

from libs.relayproto.frames import (
    ErrorFrame,
    Frame,
    FrameDecoder,
    FrameError,
    Message,
    Ping,
    Welcome,
    parts,
)
from libs.relayproto.handshake import AcceptorHandshake, Answer, DialerHandshake

READ_SIZE = 256 * 1024  # decoded bytes held unread before the socket is no longer read
HIGH_WATER = 1 << 20  # bytes queued to one connection before `send` waits
HANDSHAKE_TIMEOUT = 5.0
PING_INTERVAL = 1.0
DEAD_AFTER = 3.0  # a peer that says nothing for this long is gone (a hung or paused process)


class Offered(Enum):
    SENT = "sent"
    FULL = "destination_full"
    CLOSED = "destination_closed"


class Connection(asyncio.Protocol):
    """One TCP connection: framed writes that never raise, framed reads in arrival order.

    It is the transport's protocol itself, not a stream on top of one: each read is decoded
    where it landed (a message is a view of it, see frames.py), where a stream reader would
    copy every byte into its buffer and out again. Reading pauses while more than READ_SIZE
    decoded bytes wait for `read_frames` (backpressure: a relay that waits for a member's
    token bucket stops reading its socket). Make one with `open_connection` or `serve`."""

    def __init__(self, on_made: Callable[[Connection], object] | None = None) -> None:
        self.transport: asyncio.Transport | None = None
        self.decoder = FrameDecoder()
        self.closed = False
        self.heard = time.monotonic()  # when the peer last sent anything
        self.silent = False  # ended by `keep_alive`: the peer fell silent
        # Handed on by another relay of a shared port (the relay's side: not again; the
        # member's: it named its relay to another first).
        self.routed = False
        self._on_made = on_made
        self._frames: list[Frame] = []  # read, not yet handed to the session
        self._unread = 0  # bytes behind them
        self._reading_paused = False
        self._ended: BaseException | None = None  # why no more frames come: EOF, reset, garbage
        self._readable: asyncio.Future[None] | None = None
        self._writable = asyncio.Event()
        self._writable.set()

    # -- the transport's callbacks -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        try:
            self.transport.set_write_buffer_limits(high=HIGH_WATER)
        except RuntimeError:  # uvloop: the peer reset the connection before it was framed
            self.closed = True
        if self._on_made is not None:
            self._on_made(self)

    def data_received(self, data: bytes) -> None:
        self.heard = time.monotonic()
        if self._ended is not None:
            return
        try:
            self._frames += self.decoder.feed(data)
        except FrameError as error:
            self._end(error)
            return
        self._unread += len(data)
        if self._unread > READ_SIZE and not self._reading_paused and self.transport is not None:
            self._reading_paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self._end(ConnectionResetError("closed by peer"))
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._end(exc if exc is not None else ConnectionResetError("closed by peer"))
        self._writable.set()  # a writer waiting to drain finds the connection closed

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    def _end(self, why: BaseException) -> None:
        if self._ended is None:
            self._ended = why
        self._wake()

    def _wake(self) -> None:
        if self._readable is not None and not self._readable.done():
            self._readable.set_result(None)

    # -- writing -------------------------------------------------------------------------------

    @property
    def backlog(self) -> int:
        """Bytes written but not yet taken by the kernel."""
        if self.closed or self.transport is None:
            return 0
        return self.transport.get_write_buffer_size()

    def send_nowait(self, frame: Frame | bytes) -> bool:
        """Queue a frame (or an encoded one); False when the connection is gone."""
        return self.send_all([frame] if isinstance(frame, bytes) else parts(frame))

    def send_all(self, encoded: list[Message]) -> bool:
        """Queue encoded frames (or their parts) in one write; False when the connection is
        gone."""
        transport = self.transport
        if self.closed or transport is None or transport.is_closing():
            self.closed = True
            return False
        try:
            transport.writelines(encoded)
        except (RuntimeError, OSError):  # closed between the check and the write
            self.closed = True
            return False
        return True

    def offer_all(self, encoded: list[Message], limit: int) -> Offered:
        """Queue encoded frames in one write, unless `limit` bytes already wait for this
        peer: a full or gone peer is reported, never waited for."""
        transport = self.transport
        if self.closed or transport is None or transport.is_closing():
            self.closed = True
            return Offered.CLOSED
        if transport.get_write_buffer_size() > limit:
            return Offered.FULL
        return Offered.SENT if self.send_all(encoded) else Offered.CLOSED

    async def send(self, frame: Frame) -> bool:
        """Queue a frame, then wait while more than HIGH_WATER bytes are queued."""
        if not self.send_nowait(frame):
            return False
        await self.drain()
        return not self.closed

    async def drain(self) -> None:
        """Wait while more than HIGH_WATER bytes are queued (until the connection ends)."""
        while not self.closed and self.backlog > HIGH_WATER:
            self._writable.clear()
            await self._writable.wait()

    # -- reading -------------------------------------------------------------------------------

    async def read_frames(self) -> list[Frame]:
        """The next frames, in arrival order (those that came with the handshake first).
        Raises ConnectionResetError at EOF (or the error that ended the connection) and
        FrameError on malformed input, once every frame before it was handed out."""
        while not self._frames:
            if self._ended is not None:
                raise self._ended
            self._readable = asyncio.get_running_loop().create_future()
            await self._readable
        frames, self._frames = self._frames, []
        self._unread = 0
        if self._reading_paused and self.transport is not None and not self.closed:
            self._reading_paused = False
            self.transport.resume_reading()
        return frames

    async def keep_alive(self) -> None:
        """Ping the peer every PING_INTERVAL while someone reads this connection; when it has
        said nothing for DEAD_AFTER, abort (the reader wakes with a reset; `silent` says why).
        Run it as a task beside the reader; it returns when the connection ends."""
        while not self.closed:
            await asyncio.sleep(PING_INTERVAL)
            if time.monotonic() - self.heard > DEAD_AFTER:
                self.silent = True
                self.abort()
                return
            self.send_nowait(Ping(os.urandom(8)))

    # -- handshakes ----------------------------------------------------------------------------

    async def dial(
        self,
        answer: Answer,
        timeout: float = HANDSHAKE_TIMEOUT,
        expect: tuple[str, bytes] | None = None,
    ) -> Welcome:
        """The dialer's side of the handshake (`expect`: see DialerHandshake); raises
        HandshakeRefused, FrameError, TimeoutError or ConnectionError."""
        handshake = DialerHandshake(answer, expect)
        async with asyncio.timeout(timeout):
            while not handshake.established:
                for frame in await self.read_frames():
                    reply = handshake.receive(frame)
                    if reply is not None:
                        self.send_nowait(reply)
        self._frames[:0] = handshake.take_session_frames()
        self.routed = handshake.routed
        assert handshake.welcome is not None
        return handshake.welcome

    async def accept(
        self, relay_key: bytes, timeout: float = HANDSHAKE_TIMEOUT, routed: bool = False
    ) -> AcceptorHandshake:
        """The relay's side: challenge, then the dialer's hello (in `.hello`) or the relay it
        meant (`.route`; not again once `routed`)."""
        handshake = AcceptorHandshake(relay_key, routed=routed)
        self.send_nowait(handshake.challenge)
        async with asyncio.timeout(timeout):
            while not handshake.established:
                for frame in await self.read_frames():
                    handshake.receive(frame)
        self._frames[:0] = handshake.take_session_frames()
        return handshake

    async def refuse(self, code: str, message: str) -> None:
        """The acceptor's refusal: an ErrorFrame, given at most a second to leave."""
        if self.send_nowait(ErrorFrame(code, message)):
            try:
                await asyncio.wait_for(self.drain(), 1.0)
            except TimeoutError:
                pass

    def close(self) -> None:
        """Close after what is queued was written."""
        self.closed = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def abort(self) -> None:
        """Drop the connection now, without flushing (a relay that is told to die)."""
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


async def open_connection(
    host: str,
    port: int,
    timeout: float | None = None,
    factory: type[Connection] = Connection,
) -> Connection:
    """Dial a relay; raises OSError or TimeoutError."""
    loop = asyncio.get_running_loop()
    _, conn = await asyncio.wait_for(loop.create_connection(factory, host, port), timeout)
    return conn


async def serve(
    accepted: Callable[[Connection], object],
    host: str,
    port: int,
    factory: type[Connection] = Connection,
    reuse_port: bool = False,
) -> asyncio.Server:
    """Listen; `accepted` is called with each new connection (it starts the task that reads
    it, and the handshake). `reuse_port`: a port shared with the host's other relays."""
    loop = asyncio.get_running_loop()
    return await loop.create_server(
        lambda: factory(on_made=accepted), host, port, reuse_port=reuse_port or None
    )


def split_address(address: str) -> tuple[str, int]:
    """HOST:PORT or [V6HOST]:PORT -> (host, port)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)

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
from collections import deque
from enum import Enum

from libs.relayproto.frames import ErrorFrame, Frame, FrameDecoder, Ping, Welcome, encode
from libs.relayproto.handshake import AcceptorHandshake, Answer, DialerHandshake

READ_SIZE = 256 * 1024
HIGH_WATER = 1 << 20  # bytes queued to one connection before `send` waits
HANDSHAKE_TIMEOUT = 5.0
PING_INTERVAL = 1.0
DEAD_AFTER = 3.0  # a peer that says nothing for this long is gone (a hung or paused process)


class Offered(Enum):
    SENT = "sent"
    FULL = "destination_full"
    CLOSED = "destination_closed"


class Connection:
    """One TCP connection: framed writes that never raise, framed reads in arrival order."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.decoder = FrameDecoder()
        self.closed = False
        self._pending: deque[Frame] = deque()  # read, not yet handed to the session
        self.heard = time.monotonic()  # when the peer last sent anything
        self.silent = False  # ended by `keep_alive`: the peer fell silent
        try:
            writer.transport.set_write_buffer_limits(high=HIGH_WATER)
        except RuntimeError:  # uvloop: the peer reset the connection before it was framed
            self.closed = True
        # The stream's "closed" future holds the reset that ended it. Reads get the same
        # error and handle it; nothing else awaits this future, so asyncio would log it at
        # exit as "never retrieved": take it here.
        closed = asyncio.ensure_future(writer.wait_closed())
        closed.add_done_callback(_taken)

    # -- writing -------------------------------------------------------------------------------

    @property
    def backlog(self) -> int:
        """Bytes written but not yet taken by the kernel."""
        if self.closed:
            return 0
        return self.writer.transport.get_write_buffer_size()

    def send_nowait(self, frame: Frame | bytes) -> bool:
        """Queue a frame (or an encoded one); False when the connection is gone."""
        return self.send_all([frame if isinstance(frame, bytes) else encode(frame)])

    def send_all(self, encoded: list[bytes]) -> bool:
        """Queue encoded frames in one write; False when the connection is gone."""
        if self.closed or self.writer.transport.is_closing():
            self.closed = True
            return False
        try:
            self.writer.writelines(encoded)
        except (RuntimeError, OSError):  # closed between the check and the write
            self.closed = True
            return False
        return True

    def offer_all(self, encoded: list[bytes], limit: int) -> Offered:
        """Queue encoded frames in one write, unless `limit` bytes already wait for this
        peer: a full or gone peer is reported, never waited for."""
        if self.closed or self.writer.transport.is_closing():
            self.closed = True
            return Offered.CLOSED
        if self.writer.transport.get_write_buffer_size() > limit:
            return Offered.FULL
        return Offered.SENT if self.send_all(encoded) else Offered.CLOSED

    async def send(self, frame: Frame) -> bool:
        """Queue a frame, then wait while more than HIGH_WATER bytes are queued."""
        if not self.send_nowait(frame):
            return False
        await self.drain()
        return not self.closed

    async def drain(self) -> None:
        if self.closed or self.writer.transport.get_write_buffer_size() <= HIGH_WATER:
            return
        try:
            await self.writer.drain()
        except (ConnectionError, RuntimeError):
            self.closed = True

    # -- reading -------------------------------------------------------------------------------

    async def read_frames(self) -> list[Frame]:
        """The next frames, in arrival order (those that came with the handshake first).
        Raises ConnectionResetError at EOF and FrameError on malformed input."""
        if self._pending:
            frames = list(self._pending)
            self._pending.clear()
            return frames
        data = await self.reader.read(READ_SIZE)
        if not data:
            raise ConnectionResetError("closed by peer")
        self.heard = time.monotonic()
        return self.decoder.feed(data)

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

    async def dial(self, answer: Answer, timeout: float = HANDSHAKE_TIMEOUT) -> Welcome:
        """The dialer's side of the handshake; raises HandshakeRefused, FrameError,
        TimeoutError or ConnectionError."""
        handshake = DialerHandshake(answer)
        async with asyncio.timeout(timeout):
            while not handshake.established:
                for frame in await self.read_frames():
                    reply = handshake.receive(frame)
                    if reply is not None:
                        self.send_nowait(reply)
        self._pending.extend(handshake.take_session_frames())
        assert handshake.welcome is not None
        return handshake.welcome

    async def accept(
        self, relay_key: bytes, timeout: float = HANDSHAKE_TIMEOUT
    ) -> AcceptorHandshake:
        """The relay's side: challenge, then the dialer's hello (in `.hello`)."""
        handshake = AcceptorHandshake(relay_key)
        self.send_nowait(handshake.challenge)
        async with asyncio.timeout(timeout):
            while not handshake.established:
                for frame in await self.read_frames():
                    handshake.receive(frame)
        self._pending.extend(handshake.take_session_frames())
        return handshake

    async def refuse(self, code: str, message: str) -> None:
        """The acceptor's refusal: an ErrorFrame, given at most a second to leave."""
        if self.send_nowait(ErrorFrame(code, message)):
            try:
                await asyncio.wait_for(self.writer.drain(), 1.0)
            except (ConnectionError, TimeoutError, RuntimeError):
                pass

    def close(self) -> None:
        if not self.closed:
            self.closed = True
        if not self.writer.transport.is_closing():
            self.writer.close()

    def abort(self) -> None:
        """Drop the connection now, without flushing (a relay that is told to die)."""
        self.closed = True
        self.writer.transport.abort()


def _taken(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()


def split_address(address: str) -> tuple[str, int]:
    """HOST:PORT or [V6HOST]:PORT -> (host, port)."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)

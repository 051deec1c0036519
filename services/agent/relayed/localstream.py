"""A program's TCP connection at one end of a tunnel stream, as the transport's protocol.

Its bytes go to the tunnel as they are read: a stream reader between would copy every byte into
its buffer and out again, the largest cost of the sending member after the kernel and the
cipher. Reading pauses while the stream cannot take more (no credit, or the relay's queue is
full) and resumes when it can; writes wait on the transport's own flow control."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING, Protocol, cast

if TYPE_CHECKING:
    from services.agent.relayed.sockets import Bridge


class StreamOwner(Protocol):
    def readable(self, local: LocalStream) -> None:
        """The program sent bytes or closed its side: `pending` and `eof` say which."""

    def lost(self, local: LocalStream, error: Exception | None) -> None:
        """The connection is gone (reset by the program when `error` is set)."""


class LocalStream(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.owner: StreamOwner | None = None  # the tunnel, once the stream is attached
        self.bridge: Bridge | None = None
        self.pending: deque[bytes | memoryview] = deque()  # read, not yet taken by the link
        self.eof = False  # the program will send no more
        self.gone = False  # the connection is closed
        self._reading_paused = False
        self._writable = asyncio.Event()
        self._writable.set()

    # -- the transport's callbacks -------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self.pending.append(data)
        if self.owner is not None:
            self.owner.readable(self)

    def eof_received(self) -> bool:
        self.eof = True
        if self.owner is not None:
            self.owner.readable(self)
        return True  # half closed: the peer's bytes still go to the program

    def connection_lost(self, exc: Exception | None) -> None:
        self.gone = True
        self._writable.set()
        if self.owner is not None:
            self.owner.lost(self, exc)

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    # -- what the tunnel does with it ----------------------------------------------------------

    def pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None and not self.gone:
            self._reading_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self._reading_paused and self.transport is not None and not self.gone:
            self._reading_paused = False
            self.transport.resume_reading()

    def closing(self) -> bool:
        return self.gone or self.transport is None or self.transport.is_closing()

    async def drain(self) -> None:
        """Until the transport took what was written down to its low-water mark (or is gone)."""
        await self._writable.wait()

    def close(self) -> None:
        """Close after what was written has left."""
        if self.transport is not None and not self.transport.is_closing():
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

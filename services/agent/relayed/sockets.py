"""The local end of each tunnel stream: what the peer sent is written to the program's socket,
one write per stream per relay read; credit goes back to the peer as the bytes leave for the
socket; a socket that closes, resets or fails a write resets its own stream (RST to the peer,
counted by reason) and nothing else (S4)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field

from prometheus_client import Counter, Gauge

from libs.socks5 import ReplyCode
from libs.tunnel import Link

log = logging.getLogger("nodus.agent.tunnel")

STREAMS = Gauge("nodus_agent_tunnel_streams", "TCP streams open in the tunnel", ["node"])
STREAM_RESETS = Counter(
    "nodus_agent_stream_resets_total",
    "Streams reset, by reason (local_*: this side's socket; peer: the peer reset it; open_*: "
    "an open that could not complete)",
    ["node", "reason"],
)


@dataclass
class Peer:
    node: str
    address: str
    key: bytes
    link: Link
    heard: float = 0.0  # monotonic time of the last message from the peer; 0: never yet


@dataclass
class Bridge:
    """One stream spliced to a local socket."""

    peer: Peer
    stream: int
    reader: asyncio.StreamReader | None = None
    writer: asyncio.StreamWriter | None = None
    opened: asyncio.Future[int] | None = None
    credit: asyncio.Event = field(default_factory=asyncio.Event)
    finished: asyncio.Event = field(default_factory=asyncio.Event)  # both directions closed
    # Delivered, not yet written: at the end of the relay read, or (bytes the peer sent as soon
    # as it accepted, at most the stream's credit window) once the socket is attached.
    outbox: list[bytes | memoryview] = field(default_factory=list)
    written: int = 0  # delivered bytes written to the socket, not yet granted back
    draining: bool = False
    task: asyncio.Task[None] | None = None


class LocalSockets:
    def __init__(
        self,
        node: str,
        window: int,
        flush: Callable[[], None],
        background: Callable[[Coroutine[object, object, None]], None],
    ) -> None:
        """`flush` sends what the links queued (soon, once); `background` runs a task the
        tunnel holds on to."""
        self.node = node
        self.window = window
        self.bridges: dict[tuple[bytes, int], Bridge] = {}
        self._flush = flush
        self._background = background
        self._touched: dict[tuple[bytes, int], Bridge] = {}  # bridges with an outbox to write
        self._gauge = STREAMS.labels(node)

    def counted(self) -> None:
        self._gauge.set(len(self.bridges))

    def delivered(self, key: tuple[bytes, int], bridge: Bridge, data: bytes | memoryview) -> None:
        """The peer sent `data`: written at the end of the relay read (`write_out`), or once
        `splice` attaches the socket."""
        bridge.outbox.append(data)
        if bridge.writer is not None:
            self._touched[key] = bridge

    def write_out(self) -> None:
        """The end of one read from a relay: what it delivered goes to the local sockets, one
        write per stream."""
        touched, self._touched = self._touched, {}
        for key, bridge in touched.items():
            if self.bridges.get(key) is bridge:
                self.write(bridge)

    def write(self, bridge: Bridge) -> None:
        outbox = bridge.outbox
        if not outbox:
            return
        bridge.outbox = []
        writer = bridge.writer
        assert writer is not None
        if writer.transport.is_closing():
            self.reset(bridge, "local_closed")
            return
        try:
            if len(outbox) == 1:
                writer.write(outbox[0])
            else:
                writer.writelines(outbox)
        except (RuntimeError, OSError):  # closed between the check and the write
            self.reset(bridge, "local_write_failed")
            return
        bridge.written += sum(len(data) for data in outbox)
        self._grant(bridge)

    def write_eof(self, bridge: Bridge) -> None:
        writer = bridge.writer
        assert writer is not None
        if writer.transport.is_closing():
            return  # the local side is gone already; its own reader ends the stream
        try:
            if writer.can_write_eof():
                writer.write_eof()
        except (RuntimeError, OSError):
            self.reset(bridge, "local_closed")

    def reset(self, bridge: Bridge, reason: str, code: int = ReplyCode.GENERAL_FAILURE) -> None:
        """This stream alone failed on our side: RST to the peer, the local socket aborted."""
        bridge.peer.link.reset(bridge.stream, code)
        self.drop(bridge)
        STREAM_RESETS.labels(self.node, reason).inc()
        log.info("stream %d to %s reset: %s", bridge.stream, bridge.peer.node, reason)
        self._flush()

    def drop(self, bridge: Bridge) -> None:
        self.bridges.pop((bridge.peer.key, bridge.stream), None)
        bridge.outbox = []
        bridge.finished.set()
        bridge.credit.set()
        if bridge.writer is not None:
            bridge.writer.transport.abort()
        self.counted()

    def forget_if_done(self, peer: Peer, stream: int) -> None:
        if stream not in peer.link.streams:
            bridge = self.bridges.pop((peer.key, stream), None)
            if bridge is not None:
                bridge.finished.set()
                if bridge.writer is not None and bridge.task is None:
                    bridge.writer.close()

    def _grant(self, bridge: Bridge) -> None:
        """Give credit back once the bytes have left for the local socket."""
        writer = bridge.writer
        if writer is None:
            return
        if writer.transport.get_write_buffer_size() < self.window // 8:
            bridge.peer.link.consumed(bridge.stream, bridge.written)
            bridge.written = 0
        elif not bridge.draining:
            bridge.draining = True
            self._background(self._grant_after_drain(bridge))

    async def _grant_after_drain(self, bridge: Bridge) -> None:
        try:
            if bridge.writer is not None:
                await bridge.writer.drain()
        except (ConnectionError, RuntimeError):
            return  # the socket is gone: its reader resets the stream
        finally:
            bridge.draining = False
        bridge.peer.link.consumed(bridge.stream, bridge.written)
        bridge.written = 0
        self._flush()

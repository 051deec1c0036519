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
from services.agent.relayed.localstream import LocalStream

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
    local: LocalStream | None = None  # the program's socket, once attached
    opened: asyncio.Future[int] | None = None
    finish_sent: bool = False  # the program closed its side and the link said so
    # Delivered, not yet written: at the end of the relay read, or (bytes the peer sent as soon
    # as it accepted, at most the stream's credit window) once the socket is attached.
    outbox: list[bytes | memoryview] = field(default_factory=list)
    written: int = 0  # delivered bytes written to the socket, not yet granted back
    draining: bool = False
    task: asyncio.Task[None] | None = None  # an inbound stream's dial of the local port


class LocalSockets:
    def __init__(
        self,
        node: str,
        window: int,
        flush: Callable[[], None],
        background: Callable[[Coroutine[object, object, None]], None],
        writable: asyncio.Event,
    ) -> None:
        """`flush` sends what the links queued (soon, once); `background` runs a task the
        tunnel holds on to; `writable` is set while the home relay's queue has room."""
        self.node = node
        self.window = window
        self.bridges: dict[tuple[bytes, int], Bridge] = {}
        self._flush = flush
        self._background = background
        self._writable = writable
        self._touched: dict[tuple[bytes, int], Bridge] = {}  # bridges with an outbox to write
        self._gauge = STREAMS.labels(node)

    def attach(self, bridge: Bridge, local: LocalStream) -> None:
        """Splice a local socket to the stream: what the peer sent before is written to it,
        and what the program sends (some of it may be read already) goes to the peer."""
        bridge.local, local.bridge, local.owner = local, bridge, self
        self.write(bridge)  # what the peer sent before the socket was attached ...
        if bridge.peer.link.peer_finished(bridge.stream) and bridge.local is not None:
            self.write_eof(bridge)  # ... and its FIN, if it came too
        self.counted()
        if local.gone:
            self.lost(local, None)
        else:
            self.pump(bridge)

    def readable(self, local: LocalStream) -> None:
        if local.bridge is not None:
            self.pump(local.bridge)

    def lost(self, local: LocalStream, error: Exception | None) -> None:
        """The program's socket is gone. Before the stream ended both ways, that resets it
        (RST to the peer) and nothing else."""
        bridge = local.bridge
        if bridge is None or self.bridges.get((bridge.peer.key, bridge.stream)) is not bridge:
            return
        self.reset(bridge, "local_reset" if error is not None else "local_closed")

    def pump(self, bridge: Bridge) -> None:
        """Hand what the program sent to the link as far as the stream's credit and the
        relay's queue allow, and read on; else pause reading until they allow more (a
        CreditAvailable, or the relay's queue drained). Never drops a byte."""
        local, link, stream = bridge.local, bridge.peer.link, bridge.stream
        if local is None or self.bridges.get((bridge.peer.key, stream)) is not bridge:
            return
        pending = local.pending
        while pending:
            credit = link.credit(stream)
            if credit <= 0 or not self._writable.is_set():
                local.pause_reading()
                return
            data = pending[0]
            if len(data) > credit:
                data = memoryview(data)
                pending[0] = data[credit:]
                data = data[:credit]
            else:
                pending.popleft()
            link.send(stream, data)
            self._flush()
        if local.eof and not bridge.finish_sent:
            bridge.finish_sent = True
            link.finish(stream)
            self._flush()
            self.forget_if_done(bridge.peer, stream)  # the peer had finished first
            return
        local.resume_reading()

    def pump_all(self) -> None:
        """The relay's queue has room again: every stream paused on it reads on."""
        for bridge in list(self.bridges.values()):
            if bridge.local is not None and (bridge.local.pending or bridge.local.eof):
                self.pump(bridge)

    def counted(self) -> None:
        self._gauge.set(len(self.bridges))

    def delivered(self, key: tuple[bytes, int], bridge: Bridge, data: bytes | memoryview) -> None:
        """The peer sent `data`: written at the end of the relay read (`write_out`), or once
        `attach` gives the stream its socket."""
        bridge.outbox.append(data)
        if bridge.local is not None:
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
        local = bridge.local
        assert local is not None and local.transport is not None
        if local.closing():
            self.reset(bridge, "local_closed")
            return
        try:
            if len(outbox) == 1:
                local.transport.write(outbox[0])
            else:
                local.transport.writelines(outbox)
        except (RuntimeError, OSError):  # closed between the check and the write
            self.reset(bridge, "local_write_failed")
            return
        bridge.written += sum(len(data) for data in outbox)
        self._grant(bridge)

    def write_eof(self, bridge: Bridge) -> None:
        local = bridge.local
        assert local is not None and local.transport is not None
        if local.closing():
            return  # the local side is gone already; its own loss ends the stream
        try:
            if local.transport.can_write_eof():
                local.transport.write_eof()
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
        if bridge.local is not None:
            bridge.local.pending.clear()
            bridge.local.abort()
        self.counted()

    def forget_if_done(self, peer: Peer, stream: int) -> None:
        """Both directions closed: the local socket is closed once what it was sent has left."""
        if stream not in peer.link.streams:
            bridge = self.bridges.pop((peer.key, stream), None)
            if bridge is not None:
                if bridge.local is not None:
                    bridge.local.close()
                self.counted()

    def _grant(self, bridge: Bridge) -> None:
        """Give credit back once the bytes have left for the local socket."""
        local = bridge.local
        if local is None or local.transport is None:
            return
        if local.transport.get_write_buffer_size() < self.window // 8:
            bridge.peer.link.consumed(bridge.stream, bridge.written)
            bridge.written = 0
        elif not bridge.draining:
            bridge.draining = True
            self._background(self._grant_after_drain(bridge))

    async def _grant_after_drain(self, bridge: Bridge) -> None:
        try:
            if bridge.local is not None:
                await bridge.local.drain()
        finally:
            bridge.draining = False
        if bridge.local is None or bridge.local.gone:
            return  # the socket is gone: its loss resets the stream
        bridge.peer.link.consumed(bridge.stream, bridge.written)
        bridge.written = 0
        self._flush()

"""A member's tunnel on the Relayed path (G14-G16): WireGuard in user space to every peer of its
gang epoch, carried by two relays, with the link protocol inside carrying TCP streams.

Outbound: a local program's connection (through the shim and SOCKS5) becomes a stream to the
peer; inbound: a peer's stream is delivered by dialing the requested port on this member's own
advertised address. When the relay in use dies, the tunnel moves to the other one and every
link resends what was not acknowledged, so no stream inside breaks."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field

from prometheus_client import Counter, Gauge

from libs.runtime.tasks import cancel_and_wait
from libs.tunnel import (
    Closed,
    CreditAvailable,
    Data,
    Link,
    LinkError,
    OpenResult,
    Reset,
    StreamOpened,
)
from libs.tunnel.link import CONNECTION_REFUSED, GENERAL_FAILURE, HOST_UNREACHABLE
from services.agent.relayclient import RelayClient
from services.agent.wgdevice import WgDevice

log = logging.getLogger("nodus.agent.tunnel")

FAILOVERS = Counter("nodus_agent_relay_failovers_total", "Moves to the other relay", ["node"])
STREAMS = Gauge("nodus_agent_tunnel_streams", "TCP streams open in the tunnel", ["node"])
LINK_ERRORS = Counter(
    "nodus_agent_link_errors_total", "Malformed link messages from peers", ["node"]
)

HIGH_WATER = 2 << 20  # bytes queued to the relay before local reads pause
READ_SIZE = 64 * 1024
TICK = 0.02


class StreamRefused(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(f"peer refused the stream (SOCKS code {code})")
        self.code = code


@dataclass
class Peer:
    node: str
    address: str
    key: bytes
    link: Link


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
    early: list[bytes] = field(default_factory=list)  # arrived before the socket was attached
    written: int = 0  # delivered bytes written to the socket, not yet granted back
    draining: bool = False
    task: asyncio.Task[None] | None = None


class Tunnel:
    def __init__(
        self,
        node: str,
        gang: str,
        epoch: int,
        address: str,
        device: WgDevice,
        relays: list[tuple[str, str]],
        window: int = 4 << 20,
    ) -> None:
        self.node, self.gang, self.epoch, self.address = node, gang, epoch, address
        self.device = device
        self.window = window
        self.peers_by_key: dict[bytes, Peer] = {}
        self.peers_by_address: dict[str, Peer] = {}
        self.bridges: dict[tuple[bytes, int], Bridge] = {}
        self.relays = [
            RelayClient(
                name,
                addr,
                gang,
                epoch,
                node,
                device.private_key,
                device.public_key,
                self._on_message,
            )
            for name, addr in relays
        ]
        self.home: RelayClient | None = None
        self._writable = asyncio.Event()
        self._writable.set()
        self._flush_scheduled = False
        self._tasks: list[asyncio.Task[None]] = []
        self._held: set[asyncio.Task[None]] = set()
        self._relay_tasks: dict[str, asyncio.Task[None]] = {}
        self.on_path: Callable[[str], None] | None = None

    # -- lifecycle -----------------------------------------------------------------------------

    def add_peer(self, node: str, address: str, key: bytes) -> None:
        if key in self.peers_by_key or key == self.device.public_key:
            return
        side = 0 if self.device.public_key < key else 1
        peer = Peer(node, address, key, Link(side, window=self.window))
        self.peers_by_key[key] = peer
        self.peers_by_address[address] = peer
        self.device.add_peer(key)

    async def start(self) -> None:
        for relay in self.relays:
            self._relay_tasks[relay.name] = asyncio.create_task(self._keep_relay(relay))
        self._tasks = [asyncio.create_task(self._timers())]

    async def stop(self) -> None:
        for relay in self.relays:
            relay.close()
        for bridge in list(self.bridges.values()):
            if bridge.writer is not None:
                bridge.writer.close()
        tasks = [*self._tasks, *self._relay_tasks.values(), *self._held]
        tasks += [b.task for b in self.bridges.values() if b.task is not None]
        await cancel_and_wait(tasks)

    async def wait_ready(self, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while self.home is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"no relay reachable among {[r.address for r in self.relays]}")
            await asyncio.sleep(0.02)

    @property
    def path(self) -> str:
        return f"derp:{self.home.region}" if self.home is not None else "none"

    # -- relays and failover -------------------------------------------------------------------

    async def _keep_relay(self, relay: RelayClient) -> None:
        backoff = 0.2
        while True:
            try:
                await relay.connect()
                backoff = 0.2
                if self.home is None:
                    await self._make_home(relay, failover=False)
                await relay.run()
            except asyncio.CancelledError:
                raise
            except Exception as error:
                log.info("relay %s unavailable: %s", relay.name, error)
            if self.home is relay:
                await self._failover(relay)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    async def _make_home(self, relay: RelayClient, failover: bool) -> None:
        self.home = relay
        await relay.home(failover)
        for peer in self.peers_by_key.values():
            peer.link.retransmit()
        self._writable.set()
        self._schedule_flush()
        if self.on_path:
            self.on_path(self.path)

    async def _failover(self, lost: RelayClient) -> None:
        """Make-before-break: the other relay is already connected; move to it and resend."""
        self.home = None
        for relay in self.relays:
            if relay is not lost and relay.up:
                FAILOVERS.labels(self.node).inc()
                log.warning("relay %s lost; moving to %s", lost.name, relay.name)
                await self._make_home(relay, failover=True)
                return
        log.warning("relay %s lost and no other relay is up", lost.name)

    # -- sending -------------------------------------------------------------------------------

    def _background(self, work: Coroutine[object, object, None]) -> None:
        """Run `work` as a task the tunnel holds on to (the loop keeps only weak references)."""
        task = asyncio.get_running_loop().create_task(work)
        self._held.add(task)
        task.add_done_callback(self._held.discard)

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        home = self.home
        now = time.monotonic()
        for peer in self.peers_by_key.values():
            for payload in peer.link.outgoing():
                for dst, message in self.device.send(peer.key, payload, now):
                    if home is not None:
                        home.send_now(dst, message)
        if home is not None and home.backlog() > HIGH_WATER and self._writable.is_set():
            self._writable.clear()
            self._background(self._drain(home))

    async def _drain(self, relay: RelayClient) -> None:
        await relay.drain()
        self._writable.set()

    def _send_wire(self, messages: list[tuple[bytes, bytes]]) -> None:
        home = self.home
        if home is None:
            return
        for dst, message in messages:
            home.send_now(dst, message)

    async def _timers(self) -> None:
        last_wg = 0.0
        while True:
            await asyncio.sleep(TICK)
            now = time.monotonic()
            due = False
            for peer in self.peers_by_key.values():
                due |= peer.link.tick(now)
            if now - last_wg > 0.25:
                last_wg = now
                self._send_wire(self.device.tick(now))
            if due:
                self._schedule_flush()

    # -- receiving -----------------------------------------------------------------------------

    def _on_message(self, src: bytes, message: bytes) -> None:
        now = time.monotonic()
        replies, delivered = self.device.receive(message, now, src)
        self._send_wire(replies)
        for peer_key, payload in delivered:
            peer = self.peers_by_key.get(peer_key)
            if peer is None:
                continue
            try:
                events = peer.link.receive(payload, now)
            except LinkError as error:
                LINK_ERRORS.labels(self.node).inc()
                log.warning("malformed link message from %s: %s", peer.node, error)
                continue
            for event in events:
                self._on_event(peer, event)
        self._schedule_flush()

    def _on_event(self, peer: Peer, event: object) -> None:
        if isinstance(event, Data):
            bridge = self.bridges.get((peer.key, event.stream))
            if bridge is None:
                return
            if bridge.writer is None:
                # The peer may send as soon as it accepted, before our side of the splice is
                # wired up: hold the bytes (at most the stream's credit window) until it is.
                bridge.early.append(event.data)
                return
            bridge.writer.write(event.data)
            bridge.written += len(event.data)
            self._grant(bridge)
        elif isinstance(event, CreditAvailable):
            bridge = self.bridges.get((peer.key, event.stream))
            if bridge is not None:
                bridge.credit.set()
        elif isinstance(event, StreamOpened):
            bridge = Bridge(peer, event.stream)
            self.bridges[(peer.key, event.stream)] = bridge
            bridge.task = asyncio.get_running_loop().create_task(self._inbound(bridge, event.port))
        elif isinstance(event, OpenResult):
            bridge = self.bridges.get((peer.key, event.stream))
            if bridge is not None and bridge.opened is not None and not bridge.opened.done():
                bridge.opened.set_result(0 if event.ok else event.code)
        elif isinstance(event, Closed):
            bridge = self.bridges.get((peer.key, event.stream))
            if bridge is not None and bridge.writer is not None and bridge.writer.can_write_eof():
                try:
                    bridge.writer.write_eof()
                except OSError:
                    pass
            self._forget_if_done(peer, event.stream)
        elif isinstance(event, Reset):
            bridge = self.bridges.pop((peer.key, event.stream), None)
            if bridge is not None:
                bridge.finished.set()
                bridge.credit.set()
                if bridge.opened is not None and not bridge.opened.done():
                    bridge.opened.set_result(event.code)
                if bridge.writer is not None:
                    bridge.writer.transport.abort()
        STREAMS.labels(self.node).set(len(self.bridges))

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
        except ConnectionError:
            return
        finally:
            bridge.draining = False
        bridge.peer.link.consumed(bridge.stream, bridge.written)
        bridge.written = 0
        self._schedule_flush()

    def _forget_if_done(self, peer: Peer, stream: int) -> None:
        if stream not in peer.link.streams:
            bridge = self.bridges.pop((peer.key, stream), None)
            if bridge is not None:
                bridge.finished.set()
                if bridge.writer is not None and bridge.task is None:
                    bridge.writer.close()

    # -- streams -------------------------------------------------------------------------------

    async def connect(self, address: str, port: int, timeout: float = 30.0) -> Bridge:
        """Open a stream to `address:port` on a peer; StreamRefused carries the SOCKS code."""
        peer = self.peers_by_address.get(address)
        if peer is None:
            raise StreamRefused(2)  # not allowed: not a member of this gang epoch
        stream = peer.link.open_stream(port)
        bridge = Bridge(peer, stream, opened=asyncio.get_running_loop().create_future())
        self.bridges[(peer.key, stream)] = bridge
        self._schedule_flush()
        try:
            assert bridge.opened is not None
            code = await asyncio.wait_for(bridge.opened, timeout)
        except TimeoutError:
            peer.link.reset(stream, HOST_UNREACHABLE)
            self.bridges.pop((peer.key, stream), None)
            raise StreamRefused(6) from None
        if code:
            self.bridges.pop((peer.key, stream), None)
            raise StreamRefused(code)
        bridge.credit.set()
        STREAMS.labels(self.node).set(len(self.bridges))
        return bridge

    async def splice(
        self, bridge: Bridge, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Carry a local socket's bytes into the stream until it closes; the other direction
        is written as it arrives (see _on_event)."""
        bridge.reader, bridge.writer = reader, writer
        bridge.task = asyncio.current_task()
        for data in bridge.early:
            writer.write(data)
            bridge.written += len(data)
        bridge.early.clear()
        if bridge.written:
            self._grant(bridge)
        peer, stream = bridge.peer, bridge.stream
        link = peer.link
        try:
            while stream in link.streams:
                credit = link.credit(stream)
                if credit <= 0:
                    bridge.credit.clear()
                    if link.credit(stream) <= 0:
                        await bridge.credit.wait()
                    continue
                await self._writable.wait()
                data = await reader.read(min(credit, READ_SIZE))
                if not data:
                    link.finish(stream)
                    self._schedule_flush()
                    break
                link.send(stream, data)
                self._schedule_flush()
            # Keep the socket open until the peer finishes its direction too.
            if stream in link.streams:
                await bridge.finished.wait()
        except ConnectionError:
            link.reset(stream, GENERAL_FAILURE)
            self._schedule_flush()
        finally:
            bridge.task = None
            self.bridges.pop((peer.key, stream), None)
            writer.close()
            STREAMS.labels(self.node).set(len(self.bridges))

    async def _inbound(self, bridge: Bridge, port: int) -> None:
        """A peer's stream: dial the port on this member's own advertised address (G14)."""
        link = bridge.peer.link
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self.address, port), 10.0
            )
        except ConnectionRefusedError:
            link.refuse(bridge.stream, CONNECTION_REFUSED)
            self.bridges.pop((bridge.peer.key, bridge.stream), None)
            self._schedule_flush()
            return
        except (OSError, TimeoutError):
            link.refuse(bridge.stream, HOST_UNREACHABLE)
            self.bridges.pop((bridge.peer.key, bridge.stream), None)
            self._schedule_flush()
            return
        link.accept(bridge.stream)
        bridge.credit.set()
        self._schedule_flush()
        await self.splice(bridge, reader, writer)

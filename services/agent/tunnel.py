"""A member's tunnel on the Relayed path (G14-G16): WireGuard in user space to every peer of its
gang epoch, carried by two relays, with the link protocol inside carrying TCP streams.

Outbound: a local program's connection (through the shim and SOCKS5) becomes a stream to the
peer; inbound: a peer's stream is delivered by dialing the requested port on this member's own
advertised address. When the relay in use dies, the tunnel moves to the other one and every
link resends what was not acknowledged, so no stream inside breaks.

Failures stay where they belong (S4): a local socket that closes, resets or fails a write
resets its own stream (RST to the peer, counted by reason) and nothing else; a relay
connection ends only for what the relay or the network did."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field

from prometheus_client import Counter, Gauge

from libs.contracts.bounds import STREAM_WINDOW_BYTES
from libs.relayproto.client import RelayClient
from libs.runtime.tasks import TaskSet, cancel_and_wait
from libs.socks5 import ReplyCode
from libs.tunnel import (
    Closed,
    CreditAvailable,
    Data,
    Event,
    Link,
    LinkError,
    OpenResult,
    Reset,
    StreamOpened,
)
from services.agent.wgdevice import WgDevice

log = logging.getLogger("nodus.agent.tunnel")

FAILOVERS = Counter("nodus_agent_relay_failovers_total", "Moves to the other relay", ["node"])
STREAMS = Gauge("nodus_agent_tunnel_streams", "TCP streams open in the tunnel", ["node"])
STREAM_RESETS = Counter(
    "nodus_agent_stream_resets_total",
    "Streams reset, by reason (local_*: this side's socket; peer: the peer reset it; open_*: "
    "an open that could not complete)",
    ["node", "reason"],
)
LINK_ERRORS = Counter(
    "nodus_agent_link_errors_total", "Malformed link messages from peers", ["node"]
)

HIGH_WATER = 2 << 20  # bytes queued to the relay before local reads pause
READ_SIZE = 256 * 1024
# The timers run at their deadlines, at most this often (timers due together fire together;
# an acknowledgement owed for what arrived waits at most this long, so acks batch).
TICK = 0.02
# A failed open or a reset carries a SOCKS5 reply code, which the shim maps to an errno.
GENERAL_FAILURE = ReplyCode.GENERAL_FAILURE
NOT_ALLOWED = ReplyCode.NOT_ALLOWED
HOST_UNREACHABLE = ReplyCode.HOST_UNREACHABLE
CONNECTION_REFUSED = ReplyCode.CONNECTION_REFUSED
TTL_EXPIRED = ReplyCode.TTL_EXPIRED
# Fail fast (a caller's own connect timeout must hold): how long a connect waits for...
FAILOVER_WAIT = 1.0  # ...a relay to be home again, or the peer to be reachable through it
JOIN_GRACE = 5.0  # ...a peer never seen yet (the epoch has just started) to come up
LIVENESS = 0.75  # ...any word from the peer after the open went out (3 keepalives)
KEEPALIVE = 0.25  # every link says something this often, so silence means something...
SILENT = 1.5  # ...and a peer not heard from for this long is unreachable at once
OPEN_TIMEOUT = 10.0  # ...the peer's answer (it dials its own address: at once, normally)


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
    outbox: list[bytes] = field(default_factory=list)
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
        window: int = STREAM_WINDOW_BYTES,
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
                self._on_presence,
                self._write_out,
            )
            for name, addr in relays
        ]
        self.home: RelayClient | None = None
        self._writable = asyncio.Event()
        self._writable.set()
        self._reachability = asyncio.Event()  # pulsed when a relay or a peer comes or goes
        self._flush_scheduled = False
        self._touched: dict[tuple[bytes, int], Bridge] = {}  # bridges with an outbox to write
        # The relay connections, the timers, drains and inbound streams: a crash is logged.
        self._tasks = TaskSet("tunnel", log)
        self._streams_gauge = STREAMS.labels(node)
        self._keepalive_at = 0.0  # when the links next say something (KEEPALIVE)
        self._wake_at = math.inf  # when the timers sleep until
        self._wake = asyncio.Event()  # set: a deadline earlier than _wake_at was armed
        self.timer_wakeups = 0  # how often the timers woke (they sleep while nothing is due)

    # -- lifecycle -----------------------------------------------------------------------------

    def add_peer(self, node: str, address: str, key: bytes) -> None:
        if key in self.peers_by_key or key == self.device.public_key:
            return
        side = 0 if self.device.public_key < key else 1
        peer = Peer(node, address, key, Link(side, window=self.window))
        self.peers_by_key[key] = peer
        self.peers_by_address[address] = peer
        self.device.add_peer(key)
        self._rearm()

    async def start(self) -> None:
        for relay in self.relays:
            self._tasks.spawn(
                relay.keep(self._relay_up, self._relay_down, log), name=f"relay {relay.name}"
            )
        self._tasks.spawn(self._timers(), name="timers")

    async def stop(self) -> None:
        for relay in self.relays:
            relay.close()
        for bridge in list(self.bridges.values()):
            if bridge.writer is not None:
                bridge.writer.close()
        await self._tasks.close()
        # Outbound streams run in the SOCKS entry's tasks.
        await cancel_and_wait([b.task for b in self.bridges.values() if b.task is not None])

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

    def _relay_up(self, relay: RelayClient) -> None:
        if self.home is None:
            self._make_home(relay, failover=False)

    def _relay_down(self, relay: RelayClient) -> None:
        if self.home is relay:
            self._failover(relay)

    def _make_home(self, relay: RelayClient, failover: bool) -> None:
        self.home = relay
        relay.home(failover)
        for peer in self.peers_by_key.values():
            peer.link.retransmit()
        self._writable.set()
        self._pulse_reachability()
        self._schedule_flush()

    def _failover(self, lost: RelayClient) -> None:
        """Make-before-break: the other relay is already connected; move to it and resend."""
        self.home = None
        self._pulse_reachability()
        for relay in self.relays:
            if relay is not lost and relay.up:
                FAILOVERS.labels(self.node).inc()
                log.warning("relay %s lost; moving to %s", lost.name, relay.name)
                self._make_home(relay, failover=True)
                return
        log.warning("relay %s lost and no other relay is up", lost.name)

    def _on_presence(self, relay: RelayClient) -> None:
        self._pulse_reachability()

    def _pulse_reachability(self) -> None:
        self._reachability.set()
        self._reachability = asyncio.Event()

    def reachable(self, peer: Peer) -> bool:
        """A relay is home and can deliver to the peer (the peer is connected to it, or to a
        relay it meshes with)."""
        home = self.home
        return home is not None and home.up and peer.key in home.present

    # -- sending -------------------------------------------------------------------------------

    def _background(self, work: Coroutine[object, object, None]) -> None:
        """Run `work` as a task the tunnel holds on to (the loop keeps only weak references)."""
        self._tasks.spawn(work)

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        home = self.home
        now = time.monotonic()
        wire: list[tuple[bytes, bytes]] = []
        for peer in self.peers_by_key.values():
            for payload in peer.link.outgoing():
                wire += self.device.send(peer.key, payload, now)
        if home is not None and wire:
            home.send_many(wire)  # one write for the lot
        self._rearm()  # a send may start a handshake or arm a link's resend clock
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
        """Sleep until the next deadline (WireGuard's, a link's, the links' keepalive), at
        most every TICK (the first time TICK after the start); `_rearm` wakes it when
        something arms an earlier one."""
        last = time.monotonic()
        while True:
            now = time.monotonic()
            at = max(self._next_deadline(now), last + TICK)
            if at - now > 1e-3:
                self._wake_at = at
                self._wake.clear()
                try:
                    async with asyncio.timeout(None if at == math.inf else at - now):
                        await self._wake.wait()
                except TimeoutError:
                    pass
                self.timer_wakeups += 1
                continue
            last = now
            self._wake_at = math.inf
            self._fire_timers(now)

    def _next_deadline(self, now: float) -> float:
        at = self._keepalive_at if self.peers_by_key else math.inf
        wg = self.device.next_deadline()
        if wg is not None:
            at = min(at, wg)
        for peer in self.peers_by_key.values():
            link = peer.link.next_deadline(now)
            if link is not None:
                at = min(at, link)
        return at

    def _rearm(self) -> None:
        """Something may have armed a deadline: wake the timers if it is earlier."""
        if self._next_deadline(time.monotonic()) < self._wake_at:
            self._wake.set()

    def _fire_timers(self, now: float) -> None:
        due = False
        keepalive = now >= self._keepalive_at
        if keepalive:
            self._keepalive_at = now + KEEPALIVE
        for peer in self.peers_by_key.values():
            if keepalive:
                peer.link.keepalive()
            due |= peer.link.tick(now)
        wg = self.device.next_deadline()
        if wg is not None and wg <= now:
            self._send_wire(self.device.tick(now))
        if due:
            self._schedule_flush()

    # -- receiving -----------------------------------------------------------------------------

    def _on_message(self, src: bytes, message: bytes) -> None:
        now = time.monotonic()
        sender = self.peers_by_key.get(src)
        if sender is not None:
            sender.heard = now
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

    def _on_event(self, peer: Peer, event: Event) -> None:
        """One link event. A local socket's failure here resets its own stream; it never
        raises, so the other events of the payload and the relay connection go on."""
        key = (peer.key, event.stream)
        bridge = self.bridges.get(key)
        if isinstance(event, Data):
            if bridge is None:
                return
            bridge.outbox.append(event.data)
            if bridge.writer is not None:  # else written once `splice` attaches the socket
                self._touched[key] = bridge
        elif isinstance(event, CreditAvailable):
            if bridge is not None:
                bridge.credit.set()
        elif isinstance(event, StreamOpened):
            bridge = Bridge(peer, event.stream)
            self.bridges[key] = bridge
            bridge.task = self._tasks.spawn(self._inbound(bridge, event.port))
        elif isinstance(event, OpenResult):
            if bridge is not None and bridge.opened is not None and not bridge.opened.done():
                bridge.opened.set_result(0 if event.ok else event.code)
        elif isinstance(event, Closed):
            if bridge is not None and bridge.writer is not None:
                self._write_bridge(bridge)
                self._write_eof(bridge)
            self._forget_if_done(peer, event.stream)
        elif isinstance(event, Reset):
            if bridge is not None:
                self._drop_bridge(bridge)
                if bridge.opened is not None and not bridge.opened.done():
                    bridge.opened.set_result(event.code)
                else:
                    STREAM_RESETS.labels(self.node, "peer").inc()
                    log.info("stream %d reset by %s (code %d)", event.stream, peer.node, event.code)
        self._streams_gauge.set(len(self.bridges))

    def _write_out(self) -> None:
        """The end of one read from a relay: what it delivered goes to the local sockets, one
        write per stream."""
        touched, self._touched = self._touched, {}
        for key, bridge in touched.items():
            if self.bridges.get(key) is bridge:
                self._write_bridge(bridge)

    def _write_bridge(self, bridge: Bridge) -> None:
        outbox = bridge.outbox
        if not outbox:
            return
        bridge.outbox = []
        writer = bridge.writer
        assert writer is not None
        if writer.transport.is_closing():
            self.reset_stream(bridge, "local_closed")
            return
        try:
            if len(outbox) == 1:
                writer.write(outbox[0])
            else:
                writer.writelines(outbox)
        except (RuntimeError, OSError):  # closed between the check and the write
            self.reset_stream(bridge, "local_write_failed")
            return
        bridge.written += sum(len(data) for data in outbox)
        self._grant(bridge)

    def _write_eof(self, bridge: Bridge) -> None:
        writer = bridge.writer
        assert writer is not None
        if writer.transport.is_closing():
            return  # the local side is gone already; its own reader ends the stream
        try:
            if writer.can_write_eof():
                writer.write_eof()
        except (RuntimeError, OSError):
            self.reset_stream(bridge, "local_closed")

    def reset_stream(self, bridge: Bridge, reason: str, code: int = GENERAL_FAILURE) -> None:
        """This stream alone failed on our side: RST to the peer, the local socket aborted."""
        bridge.peer.link.reset(bridge.stream, code)
        self._drop_bridge(bridge)
        STREAM_RESETS.labels(self.node, reason).inc()
        log.info("stream %d to %s reset: %s", bridge.stream, bridge.peer.node, reason)
        self._schedule_flush()

    def _drop_bridge(self, bridge: Bridge) -> None:
        self.bridges.pop((bridge.peer.key, bridge.stream), None)
        bridge.outbox = []
        bridge.finished.set()
        bridge.credit.set()
        if bridge.writer is not None:
            bridge.writer.transport.abort()
        self._streams_gauge.set(len(self.bridges))

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
        self._schedule_flush()

    def _forget_if_done(self, peer: Peer, stream: int) -> None:
        if stream not in peer.link.streams:
            bridge = self.bridges.pop((peer.key, stream), None)
            if bridge is not None:
                bridge.finished.set()
                if bridge.writer is not None and bridge.task is None:
                    bridge.writer.close()

    # -- streams -------------------------------------------------------------------------------

    async def _wait_reachable(self, peer: Peer) -> None:
        """Return once a relay can deliver to `peer`. A peer no connected relay can reach is
        unreachable at once (StreamRefused, host unreachable); while the tunnel is failing
        over, or the peer is reachable through a relay that is not home yet, wait at most the
        failover; a peer not heard from yet (the epoch has just started) gets its join's time."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (FAILOVER_WAIT if peer.heard else JOIN_GRACE)
        while not self.reachable(peer):
            elsewhere = any(r.up and peer.key in r.present for r in self.relays)
            left = deadline - loop.time()
            if left <= 0 or (peer.heard and self.home is not None and not elsewhere):
                STREAM_RESETS.labels(self.node, "open_unreachable").inc()
                raise StreamRefused(HOST_UNREACHABLE)
            try:
                await asyncio.wait_for(self._reachability.wait(), left)
            except TimeoutError:
                pass

    async def connect(self, address: str, port: int, timeout: float = OPEN_TIMEOUT) -> Bridge:
        """Open a stream to `address:port` on a peer; StreamRefused carries the SOCKS code.

        Answers as soon as the outcome is known: a peer no relay can reach, or that has gone
        quiet (every link speaks every KEEPALIVE), is unreachable at once, one that stays
        silent after the open went out within about a second; a refusal comes back as the
        peer's own dial got it."""
        peer = self.peers_by_address.get(address)
        if peer is None:
            raise StreamRefused(NOT_ALLOWED)  # not a member of this gang epoch
        await self._wait_reachable(peer)
        if peer.heard and time.monotonic() - peer.heard > SILENT:
            STREAM_RESETS.labels(self.node, "open_unreachable").inc()
            raise StreamRefused(HOST_UNREACHABLE)  # present at the relay, but gone quiet
        loop = asyncio.get_running_loop()
        stream = peer.link.open_stream(port)
        opened: asyncio.Future[int] = loop.create_future()
        bridge = Bridge(peer, stream, opened=opened)
        self.bridges[(peer.key, stream)] = bridge
        self._schedule_flush()
        sent = time.monotonic()
        deadline = loop.time() + timeout
        while not opened.done():
            try:
                await asyncio.wait_for(asyncio.shield(opened), 0.1)
            except TimeoutError:
                pass
            if opened.done():
                break
            silent = peer.heard < sent and time.monotonic() - sent > LIVENESS
            if silent or not self.reachable(peer):
                await self._wait_reachable(peer)  # a failover under way may bring it back
                if silent and peer.heard < sent:
                    self._abandon_open(bridge, "open_unreachable", HOST_UNREACHABLE)
                    raise StreamRefused(HOST_UNREACHABLE)
            if loop.time() > deadline:
                self._abandon_open(bridge, "open_timeout", TTL_EXPIRED)
                raise StreamRefused(TTL_EXPIRED)
        code = opened.result()
        if code:
            self.bridges.pop((peer.key, stream), None)
            raise StreamRefused(code)
        bridge.credit.set()
        self._streams_gauge.set(len(self.bridges))
        return bridge

    def _abandon_open(self, bridge: Bridge, reason: str, code: int) -> None:
        bridge.peer.link.reset(bridge.stream, code)
        self.bridges.pop((bridge.peer.key, bridge.stream), None)
        STREAM_RESETS.labels(self.node, reason).inc()
        self._schedule_flush()

    async def splice(
        self,
        bridge: Bridge,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        first: bytes = b"",
    ) -> None:
        """Carry a local socket's bytes into the stream until it closes, starting with `first`
        (what the program sent before it was connected); the other direction is written as it
        arrives (see _on_event)."""
        bridge.reader, bridge.writer = reader, writer
        bridge.task = asyncio.current_task()
        self._write_bridge(bridge)  # what the peer sent before the socket was attached ...
        if bridge.peer.link.peer_finished(bridge.stream):
            self._write_eof(bridge)  # ... and its FIN, if it came too
        peer, stream = bridge.peer, bridge.stream
        link = peer.link
        pending = first  # read from the local socket, not yet taken by the link
        try:
            while stream in link.streams:
                credit = link.credit(stream)
                if credit <= 0:
                    bridge.credit.clear()
                    if link.credit(stream) <= 0:
                        await bridge.credit.wait()
                    continue
                if pending:
                    # Never dropped: what the link cannot take now waits for credit.
                    taken = link.send(stream, pending)
                    pending = pending[taken:]
                    self._schedule_flush()
                    continue
                await self._writable.wait()
                try:
                    data = await reader.read(min(credit, READ_SIZE))
                except OSError:  # reset by the local program (SO_LINGER 0) or a socket error
                    if (peer.key, stream) in self.bridges:
                        self.reset_stream(bridge, "local_reset")
                    return
                if (peer.key, stream) not in self.bridges:
                    return  # reset while we read (by the peer, or a failed local write)
                if not data:
                    link.finish(stream)
                    self._schedule_flush()
                    break
                pending = data
            # Keep the socket open until the peer finishes its direction too.
            if stream in link.streams:
                await bridge.finished.wait()
        finally:
            bridge.task = None
            self.bridges.pop((peer.key, stream), None)
            writer.close()
            self._streams_gauge.set(len(self.bridges))

    async def _inbound(self, bridge: Bridge, port: int) -> None:
        """A peer's stream: dial the port on this member's own advertised address (G14)."""
        link = bridge.peer.link
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self.address, port), OPEN_TIMEOUT - 1.0
            )
        except ConnectionRefusedError:
            self._refuse_inbound(bridge, CONNECTION_REFUSED)
            return
        except (OSError, TimeoutError):
            self._refuse_inbound(bridge, HOST_UNREACHABLE)
            return
        if (bridge.peer.key, bridge.stream) not in self.bridges:
            writer.transport.abort()  # the peer gave up (reset) while we dialled
            return
        link.accept(bridge.stream)
        bridge.credit.set()
        self._schedule_flush()
        await self.splice(bridge, reader, writer)

    def _refuse_inbound(self, bridge: Bridge, code: int) -> None:
        bridge.peer.link.refuse(bridge.stream, code)
        self.bridges.pop((bridge.peer.key, bridge.stream), None)
        self._streams_gauge.set(len(self.bridges))
        self._schedule_flush()

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
from collections.abc import Collection, Coroutine

from prometheus_client import Counter

from libs.contracts.bounds import LINK_MAX_INFLIGHT_BYTES, STREAM_WINDOW_BYTES
from libs.contracts.relay import RelayDoor
from libs.relayproto import Message
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
from services.agent.relayed.homing import RelayHome, ReturnHome
from services.agent.relayed.localstream import LocalStream
from services.agent.relayed.sockets import STREAM_RESETS, Bridge, LocalSockets, Peer
from services.agent.relayed.timers import Timers
from services.agent.relayed.wgdevice import WgDevice, Wire

log = logging.getLogger("nodus.agent.tunnel")

LINK_ERRORS = Counter(
    "nodus_agent_link_errors_total", "Malformed link messages from peers", ["node"]
)
RESENT = Counter(
    "nodus_agent_link_resent_bytes_total",
    "Link payload bytes sent again (after a relay was lost, or acknowledgements stalled): "
    "relays meter them, members are not billed for them",
    ["node"],
)

HIGH_WATER = 2 << 20  # bytes queued to the relay before local reads pause
# A failed open or a reset carries a SOCKS5 reply code, which the shim maps to an errno.
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


class Tunnel:
    def __init__(
        self,
        node: str,
        gang: str,
        epoch: int,
        address: str,
        device: WgDevice,
        relays: list[RelayDoor],
        window: int = STREAM_WINDOW_BYTES,
        totals: Collection[str] = (),
        inflight: int = LINK_MAX_INFLIGHT_BYTES,
    ) -> None:
        """`relays`: where to dial each (`member_door`), home first; `totals`: those that take
        `Sent`."""
        self.node, self.gang, self.epoch, self.address = node, gang, epoch, address
        self.device = device
        self.window = window
        self.inflight = inflight  # each link's cap on what it keeps unacknowledged (C3)
        self.peers_by_key: dict[bytes, Peer] = {}
        self.peers_by_address: dict[str, Peer] = {}
        self._writable = asyncio.Event()  # the home relay's queue has room
        self._writable.set()
        self.sockets = LocalSockets(
            node, window, self._schedule_flush, self._background, self._writable
        )
        self.bridges = self.sockets.bridges
        clients = [relay_client(self, door, door[0] in totals) for door in relays]
        self.relays = RelayHome(
            node, clients, self._moved, lambda relay: self.returning.plan(relay)
        )
        self.returning = ReturnHome(
            self.relays, lambda: [p.link for p in self.peers_by_key.values()], self._schedule_flush
        )
        self.timers = Timers(self._next_deadline, self._fire_timers)
        self._flush_scheduled = False
        # What this member's programs sent, counted once as relays meter it (resends after a
        # relay was lost are not in it), and the relay last told so: relays bill it (G17).
        self.sent_once = 0
        self._told: tuple[RelayClient | None, int] = (None, 0)
        # The relay connections, the timers, drains and inbound streams: a crash is logged.
        self._tasks = TaskSet("tunnel", log)
        self._keepalive_at = 0.0  # when the links next say something (KEEPALIVE)
        self._resent = RESENT.labels(node)

    # -- lifecycle -----------------------------------------------------------------------------

    def add_peer(self, node: str, address: str, key: bytes) -> None:
        if key in self.peers_by_key or key == self.device.public_key:
            return
        side = 0 if self.device.public_key < key else 1
        peer = Peer(node, address, key, Link(side, window=self.window, max_inflight=self.inflight))
        self.peers_by_key[key] = peer
        self.peers_by_address[address] = peer
        self.device.add_peer(key)
        self.timers.rearm()

    async def start(self) -> None:
        self.relays.keep(self._tasks)
        self._tasks.spawn(self.timers.run(), name="timers")

    async def stop(self) -> None:
        self.relays.close()
        for bridge in list(self.bridges.values()):
            if bridge.local is not None:
                bridge.local.close()
        await self._tasks.close()
        await cancel_and_wait([b.task for b in self.bridges.values() if b.task is not None])

    async def wait_ready(self, timeout: float = 10.0) -> None:
        await self.relays.wait_ready(timeout)

    @property
    def home(self) -> RelayClient | None:
        return self.relays.home

    @property
    def path(self) -> str:
        return self.relays.path

    @property
    def timer_wakeups(self) -> int:
        return self.timers.wakeups

    def reachable(self, peer: Peer) -> bool:
        return self.relays.reaches(peer.key)

    def _moved(self) -> None:
        """A relay became home: every link resends what was not acknowledged through it."""
        self.returning.stop()
        for peer in self.peers_by_key.values():
            peer.link.retransmit()
        self._writable.set()
        self._schedule_flush()

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
        home = self.relays.home
        now = time.monotonic()
        wire: Wire = []
        if self.returning.under_way:  # moving home: acknowledgements only, meanwhile
            for peer in self.peers_by_key.values():
                for pieces in peer.link.acknowledgement_parts():
                    wire += self.device.send_pieces(peer.key, pieces, now)
            if home is not None and wire:
                home.send_many(wire, None)
            self.timers.rearm()
            return
        plaintext_size = self.device.plaintext_size
        for peer in self.peers_by_key.values():
            resent, fresh = peer.link.outgoing_parts()
            for pieces in resent:
                wire += self.device.send_pieces(peer.key, pieces, now)
                self._resent.inc(plaintext_size(sum(len(piece) for piece in pieces)))
            for pieces in fresh:
                wire += self.device.send_pieces(peer.key, pieces, now)
                self.sent_once += plaintext_size(sum(len(piece) for piece in pieces))
        if home is not None and wire:
            told = self._told != (home, self.sent_once)
            self._told = (home, self.sent_once)
            home.send_many(wire, self.sent_once if told else None)  # one write for the lot
        self.timers.rearm()  # a send may start a handshake or arm a link's resend clock
        if home is not None and home.backlog() > HIGH_WATER and self._writable.is_set():
            self._writable.clear()
            self._background(self._drain(home))

    async def _drain(self, relay: RelayClient) -> None:
        await relay.drain()
        self._writable.set()
        self.sockets.pump_all()

    def _send_wire(self, messages: Wire) -> None:
        home = self.relays.home
        if home is None:
            return
        for dst, message in messages:
            home.send_now(dst, message)

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

    def _on_message(self, src: bytes, message: Message) -> None:
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
        self.returning.check()  # an acknowledgement may have been the last one awaited
        self._schedule_flush()

    def _on_event(self, peer: Peer, event: Event) -> None:
        """One link event. A local socket's failure here resets its own stream; it never
        raises, so the other events of the payload and the relay connection go on."""
        key = (peer.key, event.stream)
        bridge = self.bridges.get(key)
        if isinstance(event, Data):
            if bridge is None:
                return
            self.sockets.delivered(key, bridge, event.data)
        elif isinstance(event, CreditAvailable):
            if bridge is not None:
                self.sockets.pump(bridge)
        elif isinstance(event, StreamOpened):
            bridge = Bridge(peer, event.stream)
            self.bridges[key] = bridge
            bridge.task = self._tasks.spawn(self._inbound(bridge, event.port))
        elif isinstance(event, OpenResult):
            if bridge is not None and bridge.opened is not None and not bridge.opened.done():
                bridge.opened.set_result(0 if event.ok else event.code)
        elif isinstance(event, Closed):
            if bridge is not None and bridge.local is not None:
                self.sockets.write(bridge)
                self.sockets.write_eof(bridge)
            self.sockets.forget_if_done(peer, event.stream)
        elif isinstance(event, Reset):
            if bridge is not None:
                self.sockets.drop(bridge)
                if bridge.opened is not None and not bridge.opened.done():
                    bridge.opened.set_result(event.code)
                else:
                    STREAM_RESETS.labels(self.node, "peer").inc()
                    log.info("stream %d reset by %s (code %d)", event.stream, peer.node, event.code)
        self.sockets.counted()

    # -- streams -------------------------------------------------------------------------------

    async def _wait_reachable(self, peer: Peer) -> None:
        """Return once a relay can deliver to `peer`. A peer no connected relay can reach is
        unreachable at once (StreamRefused, host unreachable); while the tunnel is failing
        over, or the peer is reachable through a relay that is not home yet, wait at most the
        failover; a peer not heard from yet (the epoch has just started) gets its join's time."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (FAILOVER_WAIT if peer.heard else JOIN_GRACE)
        while not self.reachable(peer):
            elsewhere = self.relays.reaches_elsewhere(peer.key)
            left = deadline - loop.time()
            if left <= 0 or (peer.heard and self.relays.home is not None and not elsewhere):
                STREAM_RESETS.labels(self.node, "open_unreachable").inc()
                raise StreamRefused(HOST_UNREACHABLE)
            await self.relays.changed(left)

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
        return bridge

    def _abandon_open(self, bridge: Bridge, reason: str, code: int) -> None:
        bridge.peer.link.reset(bridge.stream, code)
        self.bridges.pop((bridge.peer.key, bridge.stream), None)
        STREAM_RESETS.labels(self.node, reason).inc()
        self._schedule_flush()

    async def _inbound(self, bridge: Bridge, port: int) -> None:
        """A peer's stream: dial the port on this member's own advertised address (G14)."""
        link = bridge.peer.link
        loop = asyncio.get_running_loop()
        try:
            _, local = await asyncio.wait_for(
                loop.create_connection(LocalStream, self.address, port), OPEN_TIMEOUT - 1.0
            )
        except ConnectionRefusedError:
            self._refuse_inbound(bridge, CONNECTION_REFUSED)
            return
        except (OSError, TimeoutError):
            self._refuse_inbound(bridge, HOST_UNREACHABLE)
            return
        finally:
            bridge.task = None
        if (bridge.peer.key, bridge.stream) not in self.bridges:
            local.abort()  # the peer gave up (reset) while we dialled
            return
        link.accept(bridge.stream)
        self._schedule_flush()
        self.sockets.attach(bridge, local)

    def _refuse_inbound(self, bridge: Bridge, code: int) -> None:
        bridge.peer.link.refuse(bridge.stream, code)
        self.bridges.pop((bridge.peer.key, bridge.stream), None)
        self.sockets.counted()
        self._schedule_flush()


def relay_client(tunnel: Tunnel, door: RelayDoor, takes_totals: bool) -> RelayClient:
    """A connection of `tunnel`'s member to a relay (not yet dialled): what it receives goes
    to the tunnel's peers, presence to its homing. `takes_totals`: the relay takes `Sent`."""
    name, address, key = door
    return RelayClient(
        name,
        address,
        tunnel.gang,
        tunnel.epoch,
        tunnel.node,
        tunnel.device.private_key,
        tunnel.device.public_key,
        tunnel._on_message,
        lambda relay: tunnel.relays.presence(relay),
        tunnel.sockets.write_out,
        takes_totals=takes_totals,
        route_key=key,
    )

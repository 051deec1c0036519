"""The relay: authenticates members by the WireGuard key recorded for their epoch, forwards
WireGuard messages only between members of one gang epoch (S2, G16), meshes one hop with the
other relays, holds each member to its share of the gang's rate (G18), and meters the bytes."""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from libs.bus import Bus
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.bounds import derive, destination_queue_bytes
from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.jobs import PathClass
from libs.contracts.relay import (
    CAPABILITY_EPOCH_RELAYS,
    CAPABILITY_ROUTE,
    CAPABILITY_USAGE_TOTALS,
    RelayRecord,
)
from libs.relayproto import (
    Absent,
    Forward,
    FrameError,
    Hello,
    Home,
    MeshHello,
    Message,
    Ping,
    Pong,
    PresenceDump,
    Present,
    Recv,
    Send,
    Sent,
    Welcome,
    member_proof,
    parts,
    wireguard_type,
    x25519_public,
)
from libs.relayproto.connection import DEAD_AFTER, Connection, Offered, serve
from libs.runtime.tasks import TaskSet
from libs.runtime.version import VERSION
from libs.wg.messages import carried_bytes
from services.relay.announce import Announcer, NameTaken
from services.relay.billing import UsageMeter
from services.relay.buckets import TokenBucket
from services.relay.membership import Identity, Membership
from services.relay.mesh import Mesh
from services.relay.metrics import (
    BUCKET_WAIT,
    BYTES,
    DESTINATION_DROPS,
    DROPPED,
    FAILOVERS,
    HANDOFFS,
    REFUSED,
    SESSIONS,
)
from services.relay.reading import read_frames
from services.relay.sharing import HandOffError, SharedPort
from services.relay.stun import StunServer

log = logging.getLogger("nodus.relay")


@dataclass
class MemberSession:
    key: bytes
    identity: Identity
    conn: Connection
    bucket: TokenBucket
    label: tuple[str, str] = ("", "")
    # The session's own counter child: no label lookup per forwarded frame (the hot path).
    bytes_out: Any = None
    # Frames routed to this member during the read being handled, written at its end: each
    # a header and the message (a view of what the sender's read brought, not a copy).
    outbox: list[Message] = field(default_factory=list)
    outbox_frames: int = 0
    outbox_bytes: int = 0
    # Bytes queued to this member before what else is meant for it is dropped (counted): more
    # than the other members' links keep in flight to it (C3, from the gang's size), so only a
    # member that stopped reading reaches it, and it costs nobody else anything.
    queue_limit: int = 0

    def __post_init__(self) -> None:
        self.bytes_out = BYTES.labels(self.identity.gang, self.identity.node, "out")
        self.queue_limit = destination_queue_bytes(self.identity.members)


class Relay:
    def __init__(
        self,
        bus: Bus,
        name: str,
        region: str,
        listen: tuple[str, int],
        mesh_with: list[str],
        mesh_key: bytes,
        private_key: bytes | None = None,
        rate_limit: bool = True,
        advertise: str | None = None,
        usage_journal: Path | None = None,
        stun_port: int | None = None,
        share_port: int | None = None,
    ) -> None:
        self.bus = bus
        self.name = name
        self.region = region
        self.listen = listen
        self.private_key = private_key or os.urandom(32)
        self.public_key = x25519_public(self.private_key)
        self.rate_limit = rate_limit
        self.advertise = advertise
        self.membership = Membership(bus)
        # STUN for Direct members behind NAT (G11), on UDP beside the members' TCP port.
        self.stun = StunServer(listen[0], stun_port) if stun_port is not None else None
        # A port of the listen host shared with the host's other relays (sharing.py): 443 for
        # members behind firewalls that open nothing else. 0 in tests: any free port.
        self.share_port = share_port
        self.shared: SharedPort | None = None
        self.shared_server: asyncio.Server | None = None
        self.meter = UsageMeter(bus, name, usage_journal)
        self.sessions: dict[bytes, MemberSession] = {}
        self.mesh = Mesh(name, region, mesh_key, mesh_with, self)
        self.announcer = Announcer(
            bus.bucket(names.BUCKET_RELAYS, RelayRecord), name, _b64(self.public_key), self._record
        )
        # Set with the error that stops a running relay: another relay took its name.
        self.failed: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.server: asyncio.Server | None = None
        self._tasks = TaskSet("relay", log)  # the relay's own loops
        self._handlers = TaskSet("relay connection", log)  # one per accepted connection
        self._touched: list[MemberSession] = []  # sessions with an outbox to write

    def _advertised(self, port: int) -> str:
        """host:port of one of this relay's ports at the host members dial."""
        host = self.advertise or self.listen[0]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    @property
    def address(self) -> str:
        return self._advertised(self.listen[1])

    @property
    def shared_address(self) -> str:
        return "" if self.shared is None else self._advertised(self.shared.port)

    @property
    def stun_address(self) -> str:
        return "" if self.stun is None else self._advertised(self.stun.port)

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        """Claim the name, serve, announce: NameTaken while another live relay holds the name
        (or took it in a race with this one; `stop` then closes what started)."""
        await self.announcer.check_credentials(self.bus)
        await self.announcer.claim()
        await self.membership.start()
        self.membership.on_fence.append(self._fence)
        self.server = await serve(self._accepted, *self.listen, factory=Connection)
        if self.listen[1] == 0:
            self.listen = (self.listen[0], self.server.sockets[0].getsockname()[1])
        if self.share_port is not None:
            await self._share_port(self.share_port)
        if self.stun is not None:
            await self.stun.start()
        self._tasks.spawn(self.meter.run(), name="usage meter")
        await self.announcer.first()
        self._tasks.spawn(self._announce(), name="announce")
        self._tasks.spawn(self._sweep_silent(), name="sweep silent members")
        self._tasks.spawn(self.mesh.run(), name="mesh links")
        shared = f", members also on {self.shared_address} (shared)" if self.shared else ""
        log.info("relay %s (%s) listening on %s%s", self.name, self.region, self.address, shared)

    async def _share_port(self, port: int) -> None:
        accepted = self._accepted
        try:
            self.shared_server = await serve(accepted, self.listen[0], port, reuse_port=True)
        except OSError as error:
            raise NodusError(
                ErrorCode.CONFLICT,
                f"relay {self.name!r}: cannot share port {port} ({error.strerror}): a process "
                "that does not share it holds it (nodus-relay.service listens on 443 alone), "
                "or relays of another user do (relays share a port only with their own user)",
            ) from None
        port = self.shared_server.sockets[0].getsockname()[1]
        self.shared = SharedPort(port, self.name, accepted)
        try:
            self.shared.open()
        except OSError as error:
            raise NodusError(
                ErrorCode.CONFLICT,
                f"relay {self.name!r}: port {port} is shared by another relay of this name on "
                f"this host ({error.strerror})",
            ) from None

    def _accepted(self, conn: Connection) -> None:
        self._handlers.spawn(self._accept(conn))

    async def stop(self) -> None:
        if self.server:
            self.server.close()
        if self.shared_server:
            self.shared_server.close()
        if self.shared is not None:
            self.shared.close()
        for session in list(self.sessions.values()):
            session.conn.close()
        self.mesh.close()
        if self.stun is not None:
            await self.stun.stop()
        await self._tasks.close()
        await self._handlers.close()
        await self.meter.flush()
        self.meter.close()
        await self.membership.stop()

    def _record(self) -> RelayRecord:
        return RelayRecord(
            name=self.name,
            region=self.region,
            address=self.address,
            public_key=_b64(self.public_key),
            version=VERSION,
            capabilities=[
                "relay-v1",
                "mesh-v1",
                CAPABILITY_USAGE_TOTALS,
                CAPABILITY_EPOCH_RELAYS,
                CAPABILITY_ROUTE,
            ],
            heartbeat_time=now(),
            stun_address=self.stun_address,
            shared_address=self.shared_address,
        )

    async def _announce(self) -> None:
        try:
            await self.announcer.run()
        except NameTaken as error:
            log.error("stopping: %s", error)
            if not self.failed.done():
                self.failed.set_exception(error)

    # -- connections ---------------------------------------------------------------------------

    async def _accept(self, conn: Connection) -> None:
        """One connection's whole life. What goes wrong here belongs to this connection: it
        is counted and the connection closed; no other session is touched."""
        try:
            handshake = await conn.accept(self.public_key, routed=conn.routed)
            if handshake.route is not None:
                if handshake.route != self.name:
                    await self._hand_off(conn, handshake.route)
                    return
                # It meant this relay, whose key its record did not show (a restart with a new
                # key): challenged again, it answers whatever the key.
                handshake = await conn.accept(self.public_key, routed=True)
            hello = handshake.hello
            if isinstance(hello, Hello):
                await self._member(conn, hello, handshake.nonce)
            elif isinstance(hello, MeshHello):
                await self.mesh.inbound(conn, hello, handshake.nonce)
        except FrameError as error:
            DROPPED.labels("malformed").inc()
            await conn.refuse("malformed", str(error))
        except (TimeoutError, OSError):
            pass  # the peer went away or never finished its hello
        finally:
            conn.close()

    async def _hand_off(self, conn: Connection, relay: str) -> None:
        """A member meant another relay of this host's shared port: pass it its connection."""
        try:
            if self.shared is None:
                raise HandOffError(f"relay {self.name} shares no port with other relays")
            await self.shared.hand_off(conn, relay)
            HANDOFFS.inc()
        except HandOffError as error:
            REFUSED.labels("no_such_relay").inc()
            await conn.refuse("NoSuchRelay", str(error))

    async def _member(self, conn: Connection, hello: Hello, nonce: bytes) -> None:
        identity = await self.membership.admit(hello.wg_key, hello.gang, hello.epoch, hello.node)
        expected = member_proof(
            self.private_key, hello.wg_key, nonce, hello.gang, hello.epoch, hello.node
        )
        if identity is None or (identity.gang, identity.epoch, identity.node) != (
            hello.gang,
            hello.epoch,
            hello.node,
        ):
            REFUSED.labels("not_a_member").inc()
            await conn.refuse(
                "NotAMember",
                f"{hello.node} is not a live member of {hello.gang} epoch {hello.epoch}",
            )
            return
        if not hmac.compare_digest(expected, hello.proof):
            REFUSED.labels("bad_proof").inc()
            await conn.refuse("BadProof", "the proof does not match the member's WireGuard key")
            return
        bounds = derive(PathClass.RELAYED, identity.members)
        rate = bounds.relay_member_bits_per_second if self.rate_limit else 0
        session = MemberSession(
            hello.wg_key, identity, conn, TokenBucket(rate), (identity.gang, identity.node)
        )
        old = self.sessions.get(hello.wg_key)
        if old is not None:
            old.conn.close()
        self.sessions[hello.wg_key] = session
        SESSIONS.set(len(self.sessions))
        conn.send_nowait(Welcome(self.name, self.region, rate))
        conn.send_nowait(PresenceDump(tuple(self._reachable_peers(session))))
        self.mesh.tell(Present(hello.wg_key, identity.gang, identity.epoch))
        self.presence_changed(hello.wg_key, identity.gang, identity.epoch)
        try:
            await self._member_loop(session)
        finally:
            if self.sessions.get(hello.wg_key) is session:
                del self.sessions[hello.wg_key]
                SESSIONS.set(len(self.sessions))
                self.mesh.tell(Absent(hello.wg_key))
                self.presence_changed(hello.wg_key, identity.gang, identity.epoch)

    async def _member_loop(self, session: MemberSession) -> None:
        """Read one member's frames and forward them. Only this member's own conduct ends its
        session (EOF, garbage, a fenced epoch); a destination that is gone or full loses the
        frames meant for it, counted, and the sender never notices."""
        conn = session.conn
        gang, node = session.label
        sent = BYTES.labels(gang, node, "in")
        waited = BUCKET_WAIT.labels(gang, node)
        identity = session.identity
        while (frames := await read_frames(conn)) is not None:
            sends: list[Send] = []
            for frame in frames:
                if isinstance(frame, Send):
                    sends.append(frame)
                elif isinstance(frame, Ping):
                    conn.send_nowait(Pong(frame.data))
                elif isinstance(frame, Sent):
                    self.meter.report(identity.gang, identity.epoch, identity.node, frame.total)
                elif isinstance(frame, Home):
                    if frame.failover:
                        FAILOVERS.inc()
                elif isinstance(frame, Pong):
                    pass
                else:
                    DROPPED.labels("unexpected_frame").inc()
            if not sends:
                continue
            size = sum(len(frame.message) for frame in sends)
            delay = await session.bucket.take(size)  # pauses reads: TCP backpressure
            if delay:
                waited.inc(delay)
            if self.membership.identity(session.key) is None:
                DROPPED.labels("fenced").inc()
                conn.close()
                return
            sent.inc(size)
            carried = 0  # billed: what the member's programs sent, not WireGuard's own bytes
            forwards = []
            for frame in sends:
                carried += carried_bytes(frame.message)
                mesh = self._route(session.key, frame.dst, frame.message)
                if mesh is not None:
                    forwards.append((mesh, Forward(session.key, frame.dst, frame.message)))
            self.meter.add(identity.gang, identity.epoch, identity.node, carried)
            self._write_out()
            for mesh, forward in forwards:
                # Onto the shared mesh link: the sender waits while it is full (its own
                # backpressure), never a destination behind it.
                if not await mesh.send(forward):
                    DROPPED.labels("mesh_closed").inc()  # the link dropped as we forwarded

    def _route(
        self, src: bytes, dst: bytes, message: Message, from_mesh: bool = False
    ) -> Connection | None:
        """Deliver to a member homed here without waiting for it; returns the mesh link to
        forward on when the destination is on another relay."""
        if wireguard_type(message) is None:
            DROPPED.labels("not_wireguard").inc()
            return None
        if not self.membership.same_epoch(src, dst):
            DROPPED.labels("not_same_gang_epoch").inc()
            return None
        local = self.sessions.get(dst)
        if local is not None:
            local.outbox += parts(Recv(src, message))
            local.outbox_frames += 1
            local.outbox_bytes += len(message)
            self._touched.append(local)
            return None
        if not from_mesh:
            link = self.mesh.link_for(dst)
            if link is not None:
                return link
        DROPPED.labels("no_route").inc()
        return None

    def _write_out(self) -> None:
        """What one read routed to members homed here, one write per member, never waiting:
        a member that is gone or whose queue is full loses these frames (counted)."""
        touched, self._touched = self._touched, []
        for local in touched:
            if not local.outbox:
                continue
            pieces, frames, size = local.outbox, local.outbox_frames, local.outbox_bytes
            local.outbox, local.outbox_frames, local.outbox_bytes = [], 0, 0
            offered = local.conn.offer_all(pieces, local.queue_limit)
            if offered is Offered.SENT:
                local.bytes_out.inc(size)
            else:
                DROPPED.labels(offered.value).inc(frames)
                DESTINATION_DROPS.labels(*local.label, offered.value).inc(frames)

    def _fence(self, gang: str, epoch: int) -> None:
        """G9: a fenced epoch's sessions are closed; its frames are dropped from now on."""
        for session in list(self.sessions.values()):
            if (session.identity.gang, session.identity.epoch) == (gang, epoch):
                log.info("fenced %s epoch %d: closing %s", gang, epoch, session.identity.node)
                session.conn.close()

    async def _sweep_silent(self) -> None:
        """Members ping every second; one that has said nothing for DEAD_AFTER is gone (a
        paused or hung agent): its session ends, so its peers learn it is unreachable."""
        while True:
            await asyncio.sleep(1.0)
            t = time.monotonic()
            for session in list(self.sessions.values()):
                if t - session.conn.heard > DEAD_AFTER:
                    log.info(
                        "%s of %s silent for %.1f s: closing its session",
                        session.identity.node,
                        session.identity.gang,
                        t - session.conn.heard,
                    )
                    session.conn.abort()

    # -- presence ------------------------------------------------------------------------------

    def _reachable_peers(self, session: MemberSession) -> list[Present]:
        """The members of `session`'s epoch this relay can deliver to (homed here or on a
        relay we have a mesh link to)."""
        gang, epoch = session.identity.gang, session.identity.epoch
        keys = {
            k
            for k, s in self.sessions.items()
            if (s.identity.gang, s.identity.epoch) == (gang, epoch)
        }
        keys |= self.mesh.present_in(gang, epoch)
        keys.discard(session.key)
        return [Present(k, gang, epoch) for k in sorted(keys)]

    def _reachable(self, key: bytes) -> bool:
        return key in self.sessions or self.mesh.reachable(key)

    # -- what the mesh asks of us (mesh.Homed) -------------------------------------------------

    def homed(self) -> list[Present]:
        return [Present(k, s.identity.gang, s.identity.epoch) for k, s in self.sessions.items()]

    def is_homed(self, key: bytes) -> bool:
        return key in self.sessions

    def deliver(self, forwards: list[Forward]) -> None:
        for frame in forwards:
            self._route(frame.src, frame.dst, frame.message, from_mesh=True)
        self._write_out()

    def presence_changed(self, key: bytes, gang: str, epoch: int) -> None:
        """Tell the epoch's members homed here whether `key` is reachable through us now."""
        frame: Present | Absent = Present(key, gang, epoch) if self._reachable(key) else Absent(key)
        for other in list(self.sessions.values()):
            if other.key != key and (other.identity.gang, other.identity.epoch) == (gang, epoch):
                other.conn.send_nowait(frame)


def _b64(raw: bytes) -> str:
    import base64

    return base64.b64encode(raw).decode()

"""The relay: authenticates members by the WireGuard key recorded for their epoch, forwards
WireGuard messages only between members of one gang epoch (S2, G16), meshes one hop with the
other relays, holds each member to its share of the gang's rate (G18), and meters the bytes."""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import secrets
from dataclasses import dataclass
from typing import Any

from libs.bus import Bus
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.bounds import derive
from libs.contracts.jobs import PathClass
from libs.contracts.relay import RelayRecord
from libs.relayproto import (
    Absent,
    Challenge,
    ErrorFrame,
    Forward,
    Frame,
    FrameError,
    Hello,
    Home,
    MeshHello,
    Ping,
    Pong,
    PresenceDump,
    Present,
    Recv,
    Send,
    Welcome,
    member_proof,
    mesh_proof,
    wireguard_type,
    x25519_public,
)
from libs.relayproto.connection import Connection
from libs.runtime.tasks import cancel_and_wait
from services.relay.billing import UsageMeter
from services.relay.buckets import TokenBucket
from services.relay.membership import Identity, Membership
from services.relay.metrics import (
    BUCKET_WAIT,
    BYTES,
    DROPPED,
    FAILOVERS,
    MESH_LOSSES,
    MESH_PEERS,
    REFUSED,
    SESSIONS,
)

log = logging.getLogger("nodus.relay")
VERSION = "0.1.0"
READ_SIZE = 256 * 1024


@dataclass
class MemberSession:
    key: bytes
    identity: Identity
    conn: Connection
    bucket: TokenBucket
    label: tuple[str, str] = ("", "")
    # The session's own counter child: no label lookup per forwarded frame (the hot path).
    bytes_out: Any = None

    def __post_init__(self) -> None:
        self.bytes_out = BYTES.labels(self.identity.gang, self.identity.node, "out")


@dataclass
class MeshPeer:
    """Our outbound link to another relay: we forward to it and tell it who is homed here."""

    address: str
    conn: Connection | None = None
    name: str = ""


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
    ) -> None:
        self.bus = bus
        self.name = name
        self.region = region
        self.listen = listen
        self.mesh_key = mesh_key
        self.private_key = private_key or os.urandom(32)
        self.public_key = x25519_public(self.private_key)
        self.rate_limit = rate_limit
        self.advertise = advertise
        self.boot = secrets.token_hex(4)
        self.membership = Membership(bus)
        self.meter = UsageMeter(bus, name, self.boot)
        self.sessions: dict[bytes, MemberSession] = {}
        self.peers = {address: MeshPeer(address) for address in mesh_with}
        # Who is homed on each other relay, as that relay tells us on its link to us.
        self.remote: dict[str, dict[bytes, tuple[str, int]]] = {}
        self.relays = bus.bucket(names.BUCKET_RELAYS, RelayRecord)
        self.server: asyncio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._handlers: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> str:
        host, port = self.advertise or self.listen[0], self.listen[1]
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        await self.membership.start()
        self.membership.on_fence.append(self._fence)
        self.server = await asyncio.start_server(self._accept, *self.listen, limit=READ_SIZE)
        if self.listen[1] == 0:
            self.listen = (self.listen[0], self.server.sockets[0].getsockname()[1])
        self._tasks = [
            asyncio.create_task(self.meter.run()),
            asyncio.create_task(self._announce()),
            *(asyncio.create_task(self._mesh_link(peer)) for peer in self.peers.values()),
        ]
        log.info("relay %s (%s) listening on %s", self.name, self.region, self.address)

    async def stop(self) -> None:
        if self.server:
            self.server.close()
        for session in list(self.sessions.values()):
            session.conn.close()
        for peer in self.peers.values():
            if peer.conn:
                peer.conn.close()
        await cancel_and_wait([*self._tasks, *self._handlers])
        await self.meter.flush()
        await self.membership.stop()

    async def _announce(self) -> None:
        while True:
            record = RelayRecord(
                name=self.name,
                region=self.region,
                address=self.address,
                public_key=_b64(self.public_key),
                version=VERSION,
                capabilities=["relay-v1", "mesh-v1"],
                heartbeat_time=now(),
            )
            try:
                await self.relays.put(self.name, record)
            except Exception as error:  # the bus reconnects; keep announcing
                log.warning("announce failed: %s", error)
            await asyncio.sleep(2.0)

    # -- connections ---------------------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        conn = Connection(reader, writer)
        try:
            nonce = secrets.token_bytes(32)
            await conn.send(Challenge(self.public_key, nonce))
            first = await conn.first_frame()
            if isinstance(first, Hello):
                await self._member(conn, first, nonce)
            elif isinstance(first, MeshHello):
                await self._inbound_mesh(conn, first, nonce)
            else:
                REFUSED.labels("bad_hello").inc()
        except FrameError as error:
            DROPPED.labels("malformed").inc()
            await _refuse(conn, "malformed", str(error))
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError):
            pass
        except asyncio.CancelledError:
            pass  # the relay is stopping: end quietly (asyncio logs a cancelled handler as an error)
        finally:
            conn.close()
            self._handlers.discard(task)

    async def _member(self, conn: Connection, hello: Hello, nonce: bytes) -> None:
        identity = self.membership.identity(hello.wg_key)
        expected = member_proof(
            self.private_key, hello.wg_key, nonce, hello.gang, hello.epoch, hello.node
        )
        if identity is None or (identity.gang, identity.epoch, identity.node) != (
            hello.gang,
            hello.epoch,
            hello.node,
        ):
            REFUSED.labels("not_a_member").inc()
            await _refuse(
                conn,
                "NotAMember",
                f"{hello.node} is not a live member of {hello.gang} epoch {hello.epoch}",
            )
            return
        if not hmac.compare_digest(expected, hello.proof):
            REFUSED.labels("bad_proof").inc()
            await _refuse(conn, "BadProof", "the proof does not match the member's WireGuard key")
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
        await conn.send(Welcome(self.name, self.region, rate))
        await self._tell_peers(Present(hello.wg_key, identity.gang, identity.epoch))
        try:
            await self._member_loop(session)
        finally:
            if self.sessions.get(hello.wg_key) is session:
                del self.sessions[hello.wg_key]
                SESSIONS.set(len(self.sessions))
                await self._tell_peers(Absent(hello.wg_key))

    async def _member_loop(self, session: MemberSession) -> None:
        conn = session.conn
        gang, node = session.label
        sent = BYTES.labels(gang, node, "in")
        waited = BUCKET_WAIT.labels(gang, node)
        identity = session.identity
        while not conn.closed:
            try:
                frames = await conn.read_frames()
            except FrameError:
                DROPPED.labels("malformed").inc()
                return
            for frame in frames:
                if isinstance(frame, Send):
                    size = len(frame.message)
                    delay = await session.bucket.take(size)  # pauses reads: TCP backpressure
                    if delay:
                        waited.inc(delay)
                    if self.membership.identity(session.key) is None:
                        DROPPED.labels("fenced").inc()
                        conn.close()
                        return
                    sent.inc(size)
                    self.meter.add(identity.gang, identity.epoch, identity.node, size)
                    await self._route(session.key, frame.dst, frame.message)
                elif isinstance(frame, Ping):
                    await conn.send(Pong(frame.data))
                elif isinstance(frame, Home):
                    if frame.failover:
                        FAILOVERS.inc()
                elif isinstance(frame, Pong):
                    pass
                else:
                    DROPPED.labels("unexpected_frame").inc()

    async def _route(self, src: bytes, dst: bytes, message: bytes, from_mesh: bool = False) -> None:
        if wireguard_type(message) is None:
            DROPPED.labels("not_wireguard").inc()
            return
        if not self.membership.same_epoch(src, dst):
            DROPPED.labels("not_same_gang_epoch").inc()
            return
        local = self.sessions.get(dst)
        if local is not None:
            local.bytes_out.inc(len(message))
            await local.conn.send(Recv(src, message))
            return
        if from_mesh:
            DROPPED.labels("no_route").inc()
            return
        for relay, present in self.remote.items():
            if dst in present:
                peer = self._link_to(relay)
                if peer is not None and peer.conn is not None:
                    await peer.conn.send(Forward(src, dst, message))
                    return
        DROPPED.labels("no_route").inc()

    def _link_to(self, relay: str) -> MeshPeer | None:
        for peer in self.peers.values():
            if peer.name == relay and peer.conn is not None and not peer.conn.closed:
                return peer
        return None

    def _fence(self, gang: str, epoch: int) -> None:
        """G9: a fenced epoch's sessions are closed; its frames are dropped from now on."""
        for session in list(self.sessions.values()):
            if (session.identity.gang, session.identity.epoch) == (gang, epoch):
                log.info("fenced %s epoch %d: closing %s", gang, epoch, session.identity.node)
                session.conn.close()

    # -- mesh ----------------------------------------------------------------------------------

    async def _tell_peers(self, frame: Frame) -> None:
        for peer in self.peers.values():
            if peer.conn is not None and not peer.conn.closed:
                await peer.conn.send(frame)

    async def _mesh_link(self, peer: MeshPeer) -> None:
        """Keep our link to one mesh peer up: prove the mesh key, learn its name, dump who is
        homed here, then send presence deltas (via _tell_peers) and forwarded frames."""
        host, port = _split(peer.address)
        while True:
            conn: Connection | None = None
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 3.0)
                conn = Connection(reader, writer)
                challenge = await conn.first_frame()
                if not isinstance(challenge, Challenge):
                    raise FrameError("mesh peer did not challenge")
                await conn.send(
                    MeshHello(self.name, mesh_proof(self.mesh_key, challenge.nonce, self.name))
                )
                welcome = await conn.first_frame()
                if isinstance(welcome, ErrorFrame):
                    raise FrameError(f"mesh peer refused: {welcome.code}: {welcome.message}")
                if not isinstance(welcome, Welcome):
                    raise FrameError("mesh peer did not welcome")
                peer.name = welcome.relay
                peer.conn = conn
                self._count_mesh()
                await conn.send(
                    PresenceDump(
                        tuple(
                            Present(k, s.identity.gang, s.identity.epoch)
                            for k, s in self.sessions.items()
                        )
                    )
                )
                log.info("mesh link to %s (%s) up", peer.name, peer.address)
                while not conn.closed:
                    await conn.read_frames()  # only Pongs come back; EOF means the peer is gone
            except asyncio.CancelledError:
                raise
            except (OSError, TimeoutError, FrameError, asyncio.IncompleteReadError) as error:
                if peer.conn is not None:
                    log.warning("mesh link to %s lost: %s", peer.address, error)
                    MESH_LOSSES.labels(peer.name or peer.address).inc()
            finally:
                if conn is not None:
                    conn.close()
                peer.conn = None
                self._count_mesh()
            await asyncio.sleep(0.5)

    def _count_mesh(self) -> None:
        MESH_PEERS.set(
            sum(1 for p in self.peers.values() if p.conn is not None and not p.conn.closed)
        )

    async def _inbound_mesh(self, conn: Connection, hello: MeshHello, nonce: bytes) -> None:
        """Another relay's link to us: its presence, and frames it forwards to our members."""
        if not hmac.compare_digest(mesh_proof(self.mesh_key, nonce, hello.name), hello.proof):
            REFUSED.labels("bad_mesh_proof").inc()
            await _refuse(conn, "BadProof", "wrong mesh key")
            return
        await conn.send(Welcome(self.name, self.region, 0))
        present: dict[bytes, tuple[str, int]] = {}
        self.remote[hello.name] = present
        try:
            while not conn.closed:
                for frame in await conn.read_frames():
                    if isinstance(frame, Forward):
                        await self._route(frame.src, frame.dst, frame.message, from_mesh=True)
                    elif isinstance(frame, PresenceDump):
                        present.clear()
                        present.update({e.key: (e.gang, e.epoch) for e in frame.entries})
                    elif isinstance(frame, Present):
                        present[frame.key] = (frame.gang, frame.epoch)
                    elif isinstance(frame, Absent):
                        present.pop(frame.key, None)
                    elif isinstance(frame, Ping):
                        await conn.send(Pong(frame.data))
                    else:
                        DROPPED.labels("unexpected_frame").inc()
        finally:
            if self.remote.get(hello.name) is present:
                del self.remote[hello.name]


async def _refuse(conn: Connection, code: str, message: str) -> None:
    try:
        await conn.send(ErrorFrame(code, message))
        await asyncio.wait_for(conn.writer.drain(), 1.0)
    except (ConnectionError, TimeoutError):
        pass


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


def _b64(raw: bytes) -> str:
    import base64

    return base64.b64encode(raw).decode()

"""The relay mesh (one hop): our outbound link to every other relay, and the links they keep to
us.

On our link to a peer we prove the mesh key, learn its name, dump who is homed here, then send
presence deltas (`tell`) and the frames our members send to members homed there (`link_for`);
a keep-alive notices a peer that fell silent. On its link to us a peer tells us who is homed
there (`remote`) and forwards frames to members homed here.

The mesh knows the relay only through `Homed`: who is homed here, and how to tell them and
deliver to them. The relay knows the mesh through `tell`, `link_for`, `reachable` and
`present_in`."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from libs.relayproto import (
    Absent,
    Challenge,
    Forward,
    Frame,
    FrameError,
    MeshHello,
    Ping,
    Pong,
    PresenceDump,
    Present,
    Welcome,
    mesh_proof,
)
from libs.relayproto.connection import DEAD_AFTER, Connection, open_connection, split_address
from libs.relayproto.handshake import HandshakeRefused
from services.relay.metrics import DROPPED, MESH_LOSSES, MESH_PEERS, REFUSED
from services.relay.reading import read_frames

log = logging.getLogger("nodus.relay")

RECONNECT_DELAY = 0.5
DIAL_TIMEOUT = 3.0


class Homed(Protocol):
    """What the mesh needs of its relay."""

    @property
    def public_key(self) -> bytes:
        """The relay's own key, in the Challenge it sends every dialler."""
        ...

    def homed(self) -> Iterable[Present]:
        """Every member homed on this relay."""
        ...

    def is_homed(self, key: bytes) -> bool: ...

    def presence_changed(self, key: bytes, gang: str, epoch: int) -> None:
        """`key` (not homed here) may have become reachable or unreachable through us."""
        ...

    def deliver(self, forwards: list[Forward]) -> None:
        """Frames another relay forwarded, to members homed here; never waits."""
        ...


class _ThisRelay(Exception):
    """A mesh dial reached this very relay (its own key in the Challenge)."""


@dataclass
class MeshPeer:
    """Our outbound link to another relay: we forward to it and tell it who is homed here."""

    address: str
    conn: Connection | None = None
    name: str = ""


class Mesh:
    def __init__(self, name: str, region: str, key: bytes, peers: list[str], relay: Homed) -> None:
        self.name = name
        self.region = region
        self.key = key
        self.relay = relay
        self.peers = {address: MeshPeer(address) for address in peers}
        # Who is homed on each other relay, as that relay tells us on its link to us.
        self.remote: dict[str, dict[bytes, tuple[str, int]]] = {}

    # -- what the relay asks -------------------------------------------------------------------

    def tell(self, frame: Frame) -> None:
        """A presence change here, to every relay we have a link to."""
        for peer in self.peers.values():
            if peer.conn is not None and not peer.conn.closed:
                peer.conn.send_nowait(frame)

    def link_for(self, dst: bytes) -> Connection | None:
        """The link to forward on to reach `dst`, homed on another relay (None: no route)."""
        for relay, present in self.remote.items():
            if dst in present:
                peer = self._link_to(relay)
                if peer is not None and peer.conn is not None:
                    return peer.conn
        return None

    def reachable(self, key: bytes) -> bool:
        """`key` is homed on a relay we have a link to."""
        return any(
            key in present and self._link_to(relay) is not None
            for relay, present in self.remote.items()
        )

    def present_in(self, gang: str, epoch: int) -> set[bytes]:
        """The members of a gang epoch homed on the other relays."""
        keys: set[bytes] = set()
        for present in self.remote.values():
            keys |= {k for k, where in present.items() if where == (gang, epoch)}
        return keys

    async def run(self) -> None:
        """Keep our link to every peer up, until cancelled."""
        await asyncio.gather(*(self._keep_link(peer) for peer in self.peers.values()))

    def close(self) -> None:
        for peer in self.peers.values():
            if peer.conn:
                peer.conn.close()

    # -- our links to the other relays ---------------------------------------------------------

    def _link_to(self, relay: str) -> MeshPeer | None:
        for peer in self.peers.values():
            if peer.name == relay and peer.conn is not None and not peer.conn.closed:
                return peer
        return None

    async def _keep_link(self, peer: MeshPeer) -> None:
        """Keep our link to one mesh peer up: prove the mesh key, learn its name, dump who is
        homed here, then send presence deltas (via `tell`) and forwarded frames."""
        host, port = split_address(peer.address)

        def hello(challenge: Challenge) -> MeshHello:
            if challenge.relay_key == self.relay.public_key:
                # Every relay may be given one list of them all, itself included (one
                # relay.env for a host's relays): its own key, not its name (another relay
                # may be given the same), says this is itself. No hello: the listener's side
                # sees the connection end before one and drops it, as any half-open dial.
                raise _ThisRelay
            return MeshHello(self.name, mesh_proof(self.key, challenge.nonce, self.name))

        while True:
            conn: Connection | None = None
            try:
                conn = await open_connection(host, port, DIAL_TIMEOUT, factory=Connection)
                welcome = await conn.dial(hello)
                peer.name = welcome.relay
                peer.conn = conn
                self._count()
                conn.send_nowait(PresenceDump(tuple(self.relay.homed())))
                self._reachability_changed(peer.name)
                log.info("mesh link to %s (%s) up", peer.name, peer.address)
                pinger = asyncio.get_running_loop().create_task(conn.keep_alive())
                try:
                    while not conn.closed:  # only Pongs come back; EOF: the peer is gone
                        await conn.read_frames()
                finally:
                    pinger.cancel()
            except asyncio.CancelledError:
                raise
            except _ThisRelay:
                log.info("mesh peer %s is this relay: not linked", peer.address)
                del self.peers[peer.address]
                return
            except HandshakeRefused as refused:
                log.warning("mesh peer %s refused us: %s", peer.address, refused)
            except (OSError, TimeoutError, FrameError) as error:
                if peer.conn is not None:
                    why = f"silent for more than {DEAD_AFTER:g} s" if peer.conn.silent else error
                    log.warning("mesh link to %s lost: %s", peer.address, why)
                    MESH_LOSSES.labels(peer.name or peer.address).inc()
            finally:
                if conn is not None:
                    conn.close()
                was_up = peer.conn is not None
                peer.conn = None
                self._count()
                if was_up:
                    self._reachability_changed(peer.name)
            await asyncio.sleep(RECONNECT_DELAY)

    def _reachability_changed(self, relay: str) -> None:
        """Our link to `relay` came up or went down: its members' reachability changed."""
        for key, (gang, epoch) in list(self.remote.get(relay, {}).items()):
            if not self.relay.is_homed(key):
                self.relay.presence_changed(key, gang, epoch)

    def _count(self) -> None:
        MESH_PEERS.set(
            sum(1 for p in self.peers.values() if p.conn is not None and not p.conn.closed)
        )

    # -- the other relays' links to us ---------------------------------------------------------

    async def inbound(self, conn: Connection, hello: MeshHello, nonce: bytes) -> None:
        """Another relay's link to us: its presence, and frames it forwards to our members.
        This loop is shared by every gang crossing the mesh: it never waits for a member."""
        if not hmac.compare_digest(mesh_proof(self.key, nonce, hello.name), hello.proof):
            REFUSED.labels("bad_mesh_proof").inc()
            await conn.refuse("BadProof", "wrong mesh key")
            return
        conn.send_nowait(Welcome(self.name, self.region, 0))
        present: dict[bytes, tuple[str, int]] = {}
        self.remote[hello.name] = present
        try:
            while (frames := await read_frames(conn)) is not None:
                forwards: list[Forward] = []
                for frame in frames:
                    if isinstance(frame, Forward):
                        forwards.append(frame)
                    elif isinstance(frame, PresenceDump):
                        before = dict(present)
                        present.clear()
                        present.update({e.key: (e.gang, e.epoch) for e in frame.entries})
                        for key, where in {**before, **present}.items():
                            self._changed(key, *where)
                    elif isinstance(frame, Present):
                        present[frame.key] = (frame.gang, frame.epoch)
                        self._changed(frame.key, frame.gang, frame.epoch)
                    elif isinstance(frame, Absent):
                        gone = present.pop(frame.key, ("", 0))
                        if gone[0]:
                            self._changed(frame.key, *gone)
                    elif isinstance(frame, Ping):
                        conn.send_nowait(Pong(frame.data))
                    else:
                        DROPPED.labels("unexpected_frame").inc()
                self.relay.deliver(forwards)
        finally:
            if self.remote.get(hello.name) is present:
                del self.remote[hello.name]
                for key, where in present.items():
                    self._changed(key, *where)

    def _changed(self, key: bytes, gang: str, epoch: int) -> None:
        if not self.relay.is_homed(key):
            self.relay.presence_changed(key, gang, epoch)

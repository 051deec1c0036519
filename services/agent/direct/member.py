"""A VM's membership in one Direct gang epoch (G7, G11, G13): its `nodus0` with the epoch's key
and mesh address and, for each peer, the path WireGuard takes to it.

Every peer is reachable through the relays from the start (services/agent/fallback.py), and
goes direct once a round of ICE checks (offers in `nodus-ice`, epoch-scoped, C2) found a path:
a port rule makes WireGuard send from the port the checks opened (wgport.py) and the peer's
endpoint becomes the address the checks reached. The agents of a pair say to each other, over
`nodus0`, a few times a second, which round they are on and whether they send directly
(pairpath.py); a pair whose peer falls silent goes back to the relays at once, and new
rounds bring it back when the direct path returns. The TCP connections inside `nodus0` see
only a gap.

Each member writes its paths to `nodus-paths` when one changes; the gang's run turns them into
`NetworkDegraded`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import msgspec
from nats.errors import Error as NatsError
from prometheus_client import Counter, Gauge

from libs.bus import Bus
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.epochs import Epoch, EpochMember
from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.relay import IceOffer, Member, MemberPaths, PathHeartbeat, member_door
from libs.jobs.relays import NOWHERE, Whereabouts, nearest_first
from libs.runtime.tasks import TaskSet
from libs.wg import key_from_base64, public_key
from libs.wg.uapi import DeviceConfig, PeerConfig, UapiError
from services.agent.direct import ice
from services.agent.direct.fallback import RelayFallback
from services.agent.direct.ice import IceFailed, Offer, PairIce
from services.agent.direct.nodus0 import Nodus0
from services.agent.direct.pairpath import HEARTBEAT_INTERVAL, PairPath
from services.agent.direct.wgport import Mapping, PortMap
from services.agent.introductions import introduced_peer
from services.agent.relayed.homing import rescue_when_stranded
from services.agent.relayed.member import live_relays, spare_relays

log = logging.getLogger("nodus.agent.direct")

LISTEN_PORT = 51820
HEARTBEAT_PORT = 51821  # on the mesh address: the agents of a pair, over nodus0
MESH_PREFIX = 24  # the epoch's /24 in 100.64.0.0/10 (placer's mesh_addresses)
KEEPALIVE = 15  # seconds: under every common NAT's UDP mapping timeout
OFFER_WAIT = 30.0  # the first round: a peer that has not offered by then has not joined
ROUND_WAIT = 8.0  # a later round: the peer starts it within a heartbeat or two
SETTLE_WAIT = 10.0  # after our checks succeeded, how long the peer may take to finish its own
FIRST_ROUND_WAIT = OFFER_WAIT + ice.CHECK_TIMEOUT + SETTLE_WAIT + 5.0
RECONCILE_INTERVAL = 1.0  # endpoints set again if WireGuard roamed away from the chosen path
SESSION_KICK = 1.0  # the initiator starts a handshake again while none completed by then,
SESSION_KICK_MOST = 8.0  # and again after twice as long each time, up to this

PAIR_PATH = Gauge(
    "nodus_agent_pair_direct",
    "1 while a Direct pair sends peer to peer, 0 while it falls back to the relays",
    ["node", "peer"],
)
PAIR_FALLBACKS = Counter(
    "nodus_agent_pair_fallbacks_total", "Direct paths lost (the pair went to the relays)", ["node"]
)
PAIR_ROUNDS = Counter(
    "nodus_agent_ice_rounds_total", "ICE rounds run, by outcome", ["node", "outcome"]
)


class Superseded(Exception):
    """The peer started a later round while this one waited for it."""


@dataclass
class _Pair:
    peer: Member
    key: bytes
    path: PairPath
    relay_endpoint: str
    initiator: bool  # this side's WireGuard starts the pair's handshakes (`_open_session`)
    direct_endpoint: str | None = None
    found: ice.Path | None = None  # what the last round that joined found
    endpoint: str | None = None  # what WireGuard was last told
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    first_round: asyncio.Event = field(default_factory=asyncio.Event)
    session: asyncio.Event = field(default_factory=asyncio.Event)  # the peer was heard
    failure: str = ""

    @property
    def sends(self) -> bool:
        """Whether this side sends over `nodus0` yet: the initiator at once, the other side
        once it heard the initiator (a session is up, and its packets start none)."""
        return self.initiator or self.session.is_set()


class DirectMember:
    def __init__(
        self,
        bus: Bus,
        epoch: Epoch,
        member: EpochMember,
        wg_private: bytes,
        underlay: str | None = None,
        where: Whereabouts = NOWHERE,
    ) -> None:
        self.bus = bus
        self.where = where
        self.epoch = epoch
        self.member = member
        self.wg_private = wg_private
        self.node = member.node
        self.device = Nodus0()
        self.ports = PortMap(LISTEN_PORT)
        self.offers = bus.bucket(names.BUCKET_ICE, IceOffer)
        self.published = bus.bucket(names.BUCKET_PATHS, MemberPaths)
        self.pairs: dict[str, _Pair] = {}  # peer node -> its pair
        self.fallback: RelayFallback | None = None
        self._by_address: dict[str, _Pair] = {}
        self._heartbeats: asyncio.DatagramTransport | None = None
        self._offered: dict[str, int] = {}  # peer node -> the highest round it offered
        self._reported: dict[str, str] = {}  # what nodus-paths holds for this member
        self._changed = asyncio.Event()
        self._pairs = TaskSet("direct pair", log)
        self._tasks = TaskSet("direct member", log)
        self._stun: tuple[str, int] | None = None
        if underlay is not None:  # the machine's own address: ICE gathers there only
            ice.UNDERLAY = {underlay}

    # -- what the agent and the probe read ---------------------------------------------------

    @property
    def paths(self) -> dict[str, ice.Path]:
        """The peers reached directly, with the path the checks found."""
        return {
            node: pair.found
            for node, pair in self.pairs.items()
            if pair.path.direct and pair.found is not None
        }

    @property
    def failures(self) -> dict[str, str]:
        """The peers whose first round found no direct path, and why."""
        return {
            node: pair.failure
            for node, pair in self.pairs.items()
            if pair.first_round.is_set() and not pair.path.direct and pair.failure
        }

    def path_to(self, peer: str) -> str:
        """`direct`, or `derp:<region>` (the relays carry the pair), or `none`."""
        pair = self.pairs.get(peer)
        if pair is not None and pair.path.direct:
            return "direct"
        return self.fallback.path if self.fallback is not None else "none"

    async def first_round(self, peer: str, timeout: float = FIRST_ROUND_WAIT) -> None:
        """Until the pair's first round of checks ended (its path is what it will be, and
        WireGuard was told) and the peer was heard over `nodus0` (the pair carries)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while peer not in self.pairs:
            if asyncio.get_running_loop().time() > deadline:
                return
            await asyncio.sleep(0.05)
        pair = self.pairs[peer]
        try:
            await asyncio.wait_for(pair.first_round.wait(), timeout)
            await asyncio.wait_for(pair.session.wait(), deadline - _clock())
        except TimeoutError:
            pass

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        relays = await live_relays(self.bus)
        # The gang's two relays when the placer named them, else the two live nearest (in the
        # gang's own order among equals when its named ones are gone: gangs spread).
        relays = [r for r in relays if r.name in self.epoch.relays] or nearest_first(
            relays, self.where, spread=self.epoch.gang if self.epoch.relays else None
        )
        self._stun = next((_split(r.stun_address) for r in relays if r.stun_address), None)
        await self.device.create(self.member.address, MESH_PREFIX)
        await self.device.configure(
            DeviceConfig(private_key=self.wg_private, listen_port=LISTEN_PORT)
        )
        self.fallback = RelayFallback(
            self.node,
            self.epoch.gang,
            self.epoch.epoch,
            self.wg_private,
            public_key(self.wg_private),
            [member_door(r) for r in relays[:2]],
            LISTEN_PORT,
        )
        await self.fallback.start()
        self._tasks.spawn(
            rescue_when_stranded(
                self.fallback.relays,
                partial(spare_relays, self.bus, self.where, self.epoch.gang),
                self.fallback.client_for,
            ),
            name="fallback rescue",
        )
        self._heartbeats, _ = await asyncio.get_running_loop().create_datagram_endpoint(
            lambda: _Heartbeats(self), local_addr=(self.member.address, HEARTBEAT_PORT)
        )
        ready = asyncio.Event()
        self._tasks.spawn(self._watch_peers(ready), name="direct peers")
        self._tasks.spawn(self._watch_offers(), name="direct offers")
        self._tasks.spawn(self._send_heartbeats(), name="direct heartbeats")
        self._tasks.spawn(self._reconcile(), name="direct endpoints")
        self._tasks.spawn(self._publisher(), name="direct paths")
        await ready.wait()
        log.info(
            "%s joined %s epoch %d on the direct path: nodus0 at %s",
            self.node,
            self.epoch.gang,
            self.epoch.epoch,
            self.member.address,
        )

    async def stop(self) -> None:
        await self._pairs.close()
        await self._tasks.close()
        await self._forget_records()
        if self._heartbeats is not None:
            self._heartbeats.close()
        if self.fallback is not None:
            await self.fallback.stop()
        try:
            await self.ports.close()
        except NodusError as error:  # the rules went with the namespace, or were never made
            log.debug("port rules: %s", error)
        await self.device.close()
        for peer in self.pairs:
            try:
                PAIR_PATH.remove(self.node, peer)
            except KeyError:  # never set
                pass

    async def _forget_records(self) -> None:
        """This member's offers and paths: the epoch is over for it, and nobody reads them."""
        keys = [names.ice_key(self.epoch.gang, self.epoch.epoch, self.node, p) for p in self.pairs]
        try:
            for key in keys:
                await self.offers.delete(key)
            await self.published.delete(
                names.member_key(self.epoch.gang, self.epoch.epoch, self.node)
            )
        except (NodusError, NatsError, OSError, TimeoutError) as error:  # the bus is away
            log.info("%s epoch %d: its records stay: %s", self.epoch.gang, self.epoch.epoch, error)

    # -- peers -------------------------------------------------------------------------------

    async def _watch_peers(self, ready: asyncio.Event) -> None:
        peers = self.bus.bucket(names.BUCKET_PEERS, Member)  # what peers addressed to us (S1)
        async for change in peers.watch(
            names.peer_key(self.epoch.gang, self.epoch.epoch, self.node, "*"), caught_up=ready
        ):
            peer = introduced_peer(self.epoch, self.node, change)
            if peer is None or peer.node in self.pairs:
                continue
            try:
                key = key_from_base64(peer.wg_public_key)
            except ValueError:
                log.warning("member record %s: its WireGuard key is malformed", change.key)
                continue
            assert self.fallback is not None
            relay_endpoint = await self.fallback.endpoint(key)
            pair = _Pair(peer, key, PairPath(_clock()), relay_endpoint, self.node < peer.node)
            self.pairs[peer.node] = pair
            self._by_address[peer.address] = pair
            self._pairs.spawn(self._run_pair(pair), name=f"pair {peer.node}")
            self._pairs.spawn(self._open_session(pair), name=f"session {peer.node}")

    async def _watch_offers(self) -> None:
        """The rounds the peers start: a peer's higher round is joined (pairpath)."""
        prefix = f"{self.epoch.gang}.{self.epoch.epoch}.*.{self.node}"
        async for change in self.offers.watch(prefix):
            offer = change.value
            if offer is None or offer.epoch != self.epoch.epoch or offer.peer != self.node:
                continue
            if offer.round > self._offered.get(offer.node, -1):
                self._offered[offer.node] = offer.round
                pair = self.pairs.get(offer.node)
                if pair is not None:
                    pair.wake.set()

    async def _run_pair(self, pair: _Pair) -> None:
        await self._set_endpoint(pair)  # through the relays until a round finds the peer
        round_ = 0
        while True:
            found = await self._round(pair, round_)
            pair.path.round_ended(round_, found is not None, _clock())
            if found is not None:
                pair.direct_endpoint = f"{found.remote[0]}:{found.remote[1]}"
                pair.found = found
            await self._set_endpoint(pair)
            if pair.path.direct:  # the first datagram that opens the path on this side
                self._beat(pair)
            pair.first_round.set()
            self._publish()
            next_round = None
            while next_round is None:
                pair.wake.clear()
                try:
                    await asyncio.wait_for(pair.wake.wait(), HEARTBEAT_INTERVAL)
                except TimeoutError:
                    pass
                was_direct = pair.path.direct
                next_round = pair.path.next_round(_clock(), self._offered.get(pair.peer.node, -1))
                if was_direct and not pair.path.direct:
                    self._fell_back(pair)
            round_ = next_round

    async def _round(self, pair: _Pair, round_: int) -> ice.Path | None:
        """One round of checks with the peer; the path found, or None (and why, logged)."""
        peer = pair.peer.node
        checks = PairIce(self.node < peer, self._stun)
        mine = names.ice_key(self.epoch.gang, self.epoch.epoch, self.node, peer)
        wait = OFFER_WAIT if round_ == 0 else ROUND_WAIT
        try:
            offer = await checks.offer()
            record = IceOffer(
                gang=self.epoch.gang,
                epoch=self.epoch.epoch,
                node=self.node,
                peer=peer,
                ufrag=offer.ufrag,
                pwd=offer.pwd,
                candidates=list(offer.candidates),
                round=round_,
            )
            await self.offers.put(mine, record)
            theirs = await self._peer_offer(peer, round_, lambda o: True, wait)
            path = await checks.connect(Offer(theirs.ufrag, theirs.pwd, tuple(theirs.candidates)))
            await self.offers.put(mine, msgspec.structs.replace(record, connected=True))
            try:  # our socket answers the peer's checks until it has its path too
                await self._peer_offer(peer, round_, lambda o: o.connected, SETTLE_WAIT)
            except TimeoutError:
                log.info("%s: %s did not confirm round %d; going on", self.epoch.gang, peer, round_)
        except Superseded:
            PAIR_ROUNDS.labels(self.node, "superseded").inc()
            return None
        except (IceFailed, TimeoutError, NodusError, OSError) as error:  # this round's only
            self._no_path(pair, round_, str(error) or "no offer from the peer")
            return None
        finally:
            await checks.close()
        try:
            await self.ports.set(peer, Mapping(path.local, path.remote))
        except NodusError as error:  # this pair's rule: the other pairs go on
            self._no_path(pair, round_, str(error))
            return None
        PAIR_ROUNDS.labels(self.node, "direct").inc()
        log.info(
            "%s epoch %d: %s reached directly at %s:%d (%s to %s, round %d)",
            self.epoch.gang,
            self.epoch.epoch,
            peer,
            *path.remote,
            path.local_kind,
            path.remote_kind,
            round_,
        )
        return path

    def _no_path(self, pair: _Pair, round_: int, reason: str) -> None:
        PAIR_ROUNDS.labels(self.node, "failed").inc()
        pair.failure = reason
        # The first round's failure is news (the probe will say so); later ones, while the
        # direct path is still gone, are the retries.
        level = logging.WARNING if round_ == 0 else logging.INFO
        log.log(
            level,
            "%s epoch %d: no direct path to %s (round %d): %s; the relays carry the pair",
            self.epoch.gang,
            self.epoch.epoch,
            pair.peer.node,
            round_,
            reason,
        )

    def _fell_back(self, pair: _Pair) -> None:
        PAIR_FALLBACKS.labels(self.node).inc()
        log.warning(
            "%s epoch %d: the direct path to %s is gone (no heartbeat for %.1f s); "
            "the relays carry the pair while checks run again",
            self.epoch.gang,
            self.epoch.epoch,
            pair.peer.node,
            _clock() - pair.path.heard,
        )
        self._tasks.spawn(self._set_endpoint(pair), name=f"fallback {pair.peer.node}")
        self._publish()

    async def _peer_offer(
        self, peer: str, round_: int, accept: Callable[[IceOffer], bool], wait: float
    ) -> IceOffer:
        key = names.ice_key(self.epoch.gang, self.epoch.epoch, peer, self.node)

        async def watch() -> IceOffer:
            async for change in self.offers.watch(key):
                offer = change.value
                if offer is None or offer.epoch != self.epoch.epoch:
                    continue
                if offer.round > round_:
                    raise Superseded()
                if offer.round == round_ and accept(offer):
                    return offer
            raise NodusError(ErrorCode.INTERNAL, f"the watch of {key} ended")

        return await asyncio.wait_for(watch(), wait)

    # -- WireGuard's endpoints ---------------------------------------------------------------

    async def _open_session(self, pair: _Pair) -> None:
        """WireGuard's first handshake with the peer, started by one side only.

        Both sides set the peer at the same moment when an epoch starts, and each WireGuard
        would send an initiation at once (the keepalive, the first heartbeat). Initiations
        that cross leave no session: each side answers the other's, which drops its own,
        and then ignores the answer to it ("invalid response"); WireGuard tries again only
        after REKEY_TIMEOUT (5 s), and the pair carries nothing until then. So the side
        that controls the checks (the smaller name) initiates; the other one sends nothing
        (no keepalive, no heartbeats) until it heard the initiator over `nodus0`. An
        initiation can be lost too (the peer has no pair for us yet, the relay was not up):
        while no handshake completed, the initiator sets the peer afresh after SESSION_KICK
        (then backing off), which sends a new one at once instead of after 5 s."""
        wait = SESSION_KICK
        while True:
            try:
                await asyncio.wait_for(pair.session.wait(), wait)
                break
            except TimeoutError:
                pass
            if not pair.initiator or pair.endpoint is None:
                continue
            try:
                seen = (await self.device.state()).peers.get(pair.key)
                if seen is not None and seen.last_handshake > 0:
                    continue  # a session is up: the peer's heartbeats are on their way
                await self.device.configure(
                    DeviceConfig(peers=(PeerConfig(pair.key, remove=True),))
                )
            except (NodusError, UapiError) as error:
                log.warning("%s: no handshake yet, and nodus0 refused: %s", pair.peer.node, error)
                continue
            log.info("%s: no WireGuard handshake yet; starting one again", pair.peer.node)
            wait = min(wait * 2, SESSION_KICK_MOST)
            pair.endpoint = None
            await self._set_endpoint(pair)
        if not pair.initiator:  # its keepalive on, now that it starts no handshake
            pair.endpoint = None
            await self._set_endpoint(pair)

    def _wanted_endpoint(self, pair: _Pair) -> str:
        if pair.path.direct and pair.direct_endpoint is not None:
            return pair.direct_endpoint
        return pair.relay_endpoint

    async def _set_endpoint(self, pair: _Pair) -> None:
        endpoint = self._wanted_endpoint(pair)
        PAIR_PATH.labels(self.node, pair.peer.node).set(1 if pair.path.direct else 0)
        if endpoint == pair.endpoint:
            return
        keepalive = KEEPALIVE if pair.sends else 0
        peer = PeerConfig(pair.key, (f"{pair.peer.address}/32",), endpoint, keepalive)
        try:
            await self.device.configure(DeviceConfig(peers=(peer,)))
        except (NodusError, UapiError) as error:  # this pair's peer: the others go on
            log.warning(
                "%s: WireGuard refused the endpoint %s: %s", pair.peer.node, endpoint, error
            )
            return
        pair.endpoint = endpoint

    async def _reconcile(self) -> None:
        """WireGuard follows whichever address a peer's packets last came from; a packet
        still in flight on the other path moves it. Set back what was chosen."""
        while True:
            await asyncio.sleep(RECONCILE_INTERVAL)
            try:
                state = await self.device.state()
            except (NodusError, UapiError) as error:
                log.warning("nodus0 state unreadable: %s", error)
                continue
            for pair in list(self.pairs.values()):
                seen = state.peers.get(pair.key)
                if seen is not None and seen.endpoint != self._wanted_endpoint(pair):
                    pair.endpoint = None
                    await self._set_endpoint(pair)

    # -- heartbeats --------------------------------------------------------------------------

    async def _send_heartbeats(self) -> None:
        while True:
            transport = self._heartbeats
            if transport is not None:
                for pair in list(self.pairs.values()):
                    self._beat(pair)
            await asyncio.sleep(HEARTBEAT_INTERVAL)

    def _beat(self, pair: _Pair) -> None:
        """One heartbeat to the peer, over `nodus0` (once this side sends there)."""
        transport = self._heartbeats
        if transport is None or not pair.sends:
            return
        beat = PathHeartbeat(round=pair.path.round, direct=pair.path.direct)
        transport.sendto(msgspec.json.encode(beat), (pair.peer.address, HEARTBEAT_PORT))

    def heard(self, address: str, data: bytes) -> None:
        pair = self._by_address.get(address)
        if pair is None:
            return
        try:
            beat = msgspec.json.decode(data, type=PathHeartbeat)
        except msgspec.ValidationError:
            log.debug("a malformed heartbeat from %s", address)
            return
        pair.path.heartbeat(_clock(), beat.round, beat.direct)
        pair.session.set()
        if beat.round > pair.path.round:
            pair.wake.set()

    # -- NetworkDegraded's input -------------------------------------------------------------

    def _publish(self) -> None:
        self._changed.set()

    async def _publisher(self) -> None:
        """One writer, in order: puts spawned one per change could land out of order and
        leave an old path (a fallback already over) as the record NetworkDegraded reads."""
        key = names.member_key(self.epoch.gang, self.epoch.epoch, self.node)
        while True:
            await self._changed.wait()
            self._changed.clear()
            paths = {node: self.path_to(node) for node in self.pairs}
            if paths == self._reported:
                continue
            record = MemberPaths(
                gang=self.epoch.gang,
                epoch=self.epoch.epoch,
                node=self.node,
                paths=paths,
                changed_time=now(),
            )
            try:
                await self.published.put(key, record)
            except (NodusError, NatsError, OSError, TimeoutError) as error:  # the bus is away
                log.warning("%s: paths not published yet: %s", self.node, error)
                await asyncio.sleep(1.0)
                self._changed.set()
                continue
            self._reported = paths


class _Heartbeats(asyncio.DatagramProtocol):
    def __init__(self, member: DirectMember) -> None:
        self.member = member

    def datagram_received(self, data: bytes, addr: tuple[str | object, ...]) -> None:
        self.member.heard(str(addr[0]), data)

    def error_received(self, exc: Exception) -> None:  # a peer not listening yet
        log.debug("heartbeat: %s", exc)


def _clock() -> float:
    return asyncio.get_running_loop().time()


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)

"""A VM's membership in one Direct gang epoch (G7, G11): its `nodus0` with the epoch's key and
mesh address, and, for each peer, ICE over the bus (offers in `nodus-ice`, epoch-scoped), the
port rule that makes WireGuard send from the port the checks opened, and the peer on the
address the checks reached.

A pair's checks that find no path leave the peer without an endpoint and say why
(`failed`); the probe then reports the pair as unreachable and the placer decides (G12).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec

from libs.bus import Bus
from libs.contracts import names
from libs.contracts.epochs import Epoch, EpochMember
from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.relay import IceOffer, Member
from libs.runtime.tasks import TaskSet
from libs.wg import key_from_base64
from libs.wg.uapi import DeviceConfig, PeerConfig
from services.agent import ice
from services.agent.ice import IceFailed, Offer, PairIce, Path
from services.agent.member import live_relays
from services.agent.nodus0 import Nodus0
from services.agent.wgport import Mapping, PortMap

log = logging.getLogger("nodus.agent.direct")

LISTEN_PORT = 51820
MESH_PREFIX = 24  # the epoch's /24 in 100.64.0.0/10 (placer's mesh_addresses)
KEEPALIVE = 15  # seconds: under every common NAT's UDP mapping timeout
OFFER_WAIT = 30.0  # a peer that has not offered by then has not joined
SETTLE_WAIT = 10.0  # after our checks succeeded, how long the peer may take to finish its own


async def stun_server(bus: Bus) -> tuple[str, int] | None:
    """A live relay's STUN address, or None (host candidates only)."""
    for record in await live_relays(bus):
        if record.stun_address:
            host, _, port = record.stun_address.rpartition(":")
            return host.strip("[]"), int(port)
    return None


class DirectMember:
    def __init__(
        self,
        bus: Bus,
        epoch: Epoch,
        member: EpochMember,
        wg_private: bytes,
        underlay: str | None = None,
    ) -> None:
        self.bus = bus
        self.epoch = epoch
        self.member = member
        self.wg_private = wg_private
        self.node = member.node
        self.device = Nodus0()
        self.ports = PortMap(LISTEN_PORT)
        self.offers = bus.bucket(names.BUCKET_ICE, IceOffer)
        self.paths: dict[str, Path] = {}  # peer node -> the path its checks found
        self.failures: dict[str, str] = {}  # peer node -> why no path was found
        self._pairs = TaskSet("direct pair", log)
        self._tasks = TaskSet("direct member", log)
        self._stun: tuple[str, int] | None = None
        if underlay is not None:  # the machine's own address: ICE gathers there only
            ice.UNDERLAY = {underlay}

    async def start(self) -> None:
        self._stun = await stun_server(self.bus)
        await self.device.create(self.member.address, MESH_PREFIX)
        await self.device.configure(
            DeviceConfig(private_key=self.wg_private, listen_port=LISTEN_PORT)
        )
        ready = asyncio.Event()
        self._tasks.spawn(self._watch_peers(ready), name="direct peers")
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
        try:
            await self.ports.close()
        except NodusError as error:  # the rules went with the namespace, or were never made
            log.debug("port rules: %s", error)
        await self.device.close()

    async def _watch_peers(self, ready: asyncio.Event) -> None:
        members = self.bus.bucket(names.BUCKET_MEMBERS, Member)
        started: set[str] = set()
        async for change in members.watch(
            f"{self.epoch.gang}.{self.epoch.epoch}.*", caught_up=ready
        ):
            peer = change.value
            if peer is None or peer.node == self.node or peer.node in started:
                continue
            try:
                key = key_from_base64(peer.wg_public_key)
            except ValueError:
                log.warning("member record %s: its WireGuard key is malformed", change.key)
                continue
            started.add(peer.node)
            self._pairs.spawn(self._pair(peer, key), name=f"ice {peer.node}")

    def _key(self, node: str, peer: str) -> str:
        return names.ice_key(self.epoch.gang, self.epoch.epoch, node, peer)

    async def _pair(self, peer: Member, key: bytes) -> None:
        checks = PairIce(self.node < peer.node, self._stun)
        mine = self._key(self.node, peer.node)
        try:
            offer = await checks.offer()
            record = IceOffer(
                gang=self.epoch.gang,
                epoch=self.epoch.epoch,
                node=self.node,
                peer=peer.node,
                ufrag=offer.ufrag,
                pwd=offer.pwd,
                candidates=list(offer.candidates),
            )
            await self.offers.put(mine, record)
            theirs = await self._peer_offer(peer.node, lambda o: True, OFFER_WAIT)
            path = await checks.connect(Offer(theirs.ufrag, theirs.pwd, tuple(theirs.candidates)))
            await self.offers.put(mine, msgspec.structs.replace(record, connected=True))
            try:  # our socket answers the peer's checks until it has its path too
                await self._peer_offer(peer.node, lambda o: o.connected, SETTLE_WAIT)
            except TimeoutError:
                log.warning("%s: %s did not confirm its path; going on", self.epoch.gang, peer.node)
        except (IceFailed, TimeoutError, NodusError) as error:
            self._failed(peer.node, str(error) or "no offer from the peer")
            return
        finally:
            await checks.close()
        endpoint = f"{path.remote[0]}:{path.remote[1]}"
        try:
            await self.ports.set(peer.node, Mapping(path.local, path.remote))
            await self.device.configure(
                DeviceConfig(peers=(PeerConfig(key, (f"{peer.address}/32",), endpoint, KEEPALIVE),))
            )
        except NodusError as error:  # this pair's rule or peer: the other pairs go on
            self._failed(peer.node, str(error))
            return
        self.paths[peer.node] = path
        log.info(
            "%s epoch %d: %s reached at %s (%s to %s)",
            self.epoch.gang,
            self.epoch.epoch,
            peer.node,
            endpoint,
            path.local_kind,
            path.remote_kind,
        )

    def _failed(self, peer: str, reason: str) -> None:
        self.failures[peer] = reason
        log.warning(
            "%s epoch %d: no direct path to %s: %s",
            self.epoch.gang,
            self.epoch.epoch,
            peer,
            reason,
        )

    async def _peer_offer(
        self, peer: str, wanted: Callable[[IceOffer], bool], wait: float
    ) -> IceOffer:
        key = self._key(peer, self.node)

        async def watch() -> IceOffer:
            async for change in self.offers.watch(key):
                offer = change.value
                if offer is not None and offer.epoch == self.epoch.epoch and wanted(offer):
                    return offer
            raise NodusError(ErrorCode.INTERNAL, f"the watch of {key} ended")

        return await asyncio.wait_for(watch(), wait)

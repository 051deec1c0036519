"""A node's membership in one Relayed gang epoch: its tunnel to the peers through two relays
(another, when both are gone for good) and the SOCKS5 entry its ranks' shim dials
(NODUS_NETSHIM_SOCKS)."""

from __future__ import annotations

import asyncio
import logging
from functools import partial

from libs.bus import Bus, Versioned
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.bounds import link_inflight, stream_window
from libs.contracts.epochs import Epoch, EpochMember
from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.relay import (
    CAPABILITY_USAGE_TOTALS,
    RELAYS_PER_MEMBER,
    Member,
    RelayRecord,
    member_door,
)
from libs.jobs.relays import NOWHERE, Whereabouts, is_live, nearest_first
from libs.relayproto.client import RelayClient
from libs.runtime.tasks import cancel_and_wait
from libs.wg import key_from_base64
from services.agent.introductions import introduced_peer
from services.agent.relayed import homing
from services.agent.relayed.socks import SocksFront
from services.agent.relayed.tunnel import Tunnel, relay_client
from services.agent.relayed.wgdevice import WgDevice

log = logging.getLogger("nodus.agent.member")


def _fresh(record: RelayRecord) -> bool:
    return is_live(record, now())


def _live(records: dict[str, Versioned[RelayRecord]]) -> list[RelayRecord]:
    return sorted((r.value for r in records.values() if _fresh(r.value)), key=lambda r: r.name)


async def live_relays(bus: Bus) -> list[RelayRecord]:
    """The relays whose heartbeats are fresh, in a stable order."""
    return _live(await bus.bucket(names.BUCKET_RELAYS, RelayRecord).snapshot())


async def spare_relays(bus: Bus, where: Whereabouts, gang: str) -> list[RelayRecord]:
    """The live relays nearest `where` first, in `gang`'s own order among equals: what a
    member whose gang's relays are both lost is given one of (`homing.rescue_when_stranded`)."""
    return nearest_first(await live_relays(bus), where, spread=gang)


async def pick_relays(
    bus: Bus, named: list[str], where: Whereabouts = NOWHERE, wait: float = 30.0, gang: str = ""
) -> list[RelayRecord]:
    """The gang's relays (`named`, the placer's choice, in its order) once one of them is
    live; without names, or when neither is live within `wait`, the two live relays nearest
    the member (`where`): by name among equals without names (as the placer counts them), in
    the gang's own order when its named ones are gone (gangs spread over the relays left).
    Every relay reaches every other in one hop, so any two carry the gang."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait
    while True:
        records = await bus.bucket(names.BUCKET_RELAYS, RelayRecord).snapshot()
        chosen = [records[name].value for name in named if name in records]
        if any(_fresh(r) for r in chosen):
            return chosen
        live = nearest_first(_live(records), where, spread=gang if named and gang else None)
        late = loop.time() > deadline
        if live and (not named or late):
            if named:
                log.warning(
                    "neither of the gang's relays %s is live after %.0f s: using %s",
                    named,
                    wait,
                    [r.name for r in live[:RELAYS_PER_MEMBER]],
                )
            return live[:RELAYS_PER_MEMBER]
        if late:
            raise NodusError(
                ErrorCode.NO_RESPONDERS, "no live relay announced itself in nodus-relays"
            )
        await asyncio.sleep(0.5)


class RelayedMember:
    def __init__(
        self,
        bus: Bus,
        epoch: Epoch,
        member: EpochMember,
        wg_private: bytes,
        socks_listen: tuple[str, int],
        where: Whereabouts = NOWHERE,
    ) -> None:
        self.bus = bus
        self.where = where
        self.epoch = epoch
        self.member = member
        self.wg_private = wg_private
        self.socks_listen = socks_listen
        self.tunnel: Tunnel | None = None
        self.socks: SocksFront | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        picked = await pick_relays(self.bus, self.epoch.relays, self.where, gang=self.epoch.gang)
        slot = self.member.relay_slot % len(picked)
        picked = picked[slot:] + picked[:slot]  # home first (the placer's choice), then failover
        device = WgDevice(self.wg_private)
        bounds = self.epoch.bounds
        window = stream_window(bounds)  # the derived per-member buffer (C3), clamped
        self.tunnel = Tunnel(
            self.member.node,
            self.epoch.gang,
            self.epoch.epoch,
            self.member.address,
            device,
            [member_door(r) for r in picked],
            window,
            totals={r.name for r in picked if CAPABILITY_USAGE_TOTALS in r.capabilities},
            inflight=link_inflight(bounds),
        )
        ready = asyncio.Event()
        self._tasks = [
            asyncio.create_task(self._watch_peers(ready)),
            asyncio.create_task(
                homing.rescue_when_stranded(
                    self.tunnel.relays,
                    partial(spare_relays, self.bus, self.where, self.epoch.gang),
                    self._client_for,
                )
            ),
        ]
        await ready.wait()
        await self.tunnel.start()
        await self.tunnel.wait_ready()
        self.socks = SocksFront(self.tunnel, self.socks_listen)
        await self.socks.start()
        log.info(
            "%s joined %s epoch %d on the relayed path via %s (relays %s); SOCKS5 on %s:%d",
            self.member.node,
            self.epoch.gang,
            self.epoch.epoch,
            self.tunnel.path,
            ", ".join(r.name for r in picked),
            *self.socks_listen,
        )

    async def stop(self) -> None:
        if self.socks is not None:
            await self.socks.stop()
        if self.tunnel is not None:
            await self.tunnel.stop()
        await cancel_and_wait(self._tasks)

    async def _watch_peers(self, ready: asyncio.Event) -> None:
        peers = self.bus.bucket(names.BUCKET_PEERS, Member)  # what peers addressed to us (S1)
        prefix = names.peer_key(self.epoch.gang, self.epoch.epoch, self.member.node, "*")
        async for change in peers.watch(prefix, caught_up=ready):
            peer = introduced_peer(self.epoch, self.member.node, change)
            if peer is None or self.tunnel is None:
                continue
            try:
                key = key_from_base64(peer.wg_public_key)
            except ValueError:  # S3: a malformed record is skipped, and said so
                log.warning("member record %s: its WireGuard key is malformed", change.key)
                continue
            self.tunnel.add_peer(peer.node, peer.address, key)

    def _client_for(self, record: RelayRecord) -> RelayClient:
        assert self.tunnel is not None
        takes_totals = CAPABILITY_USAGE_TOTALS in record.capabilities
        return relay_client(self.tunnel, member_door(record), takes_totals)

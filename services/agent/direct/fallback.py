"""The relays as the second path of a Direct member's `nodus0` (G13).

For each peer, a UDP socket on the loopback stands in for the peer: while the pair is not
direct, WireGuard's endpoint for the peer is that socket, and what WireGuard sends there goes
to the peer through a relay, as the Relayed path's messages do (the member proves the
epoch's key; relays carry only WireGuard messages between members of one gang epoch). What
the relay delivers from the peer is sent to WireGuard from the same socket, so WireGuard
sees one peer, whichever path carries it, and the TCP connections inside `nodus0` go on.

Two relays homed on as the Relayed path's are (`RelayHome`): the gang's first relay is home,
when it goes the other one, and when both are lost for good another live relay
(`rescue_when_stranded`, which the member runs). Datagrams are datagrams: one that cannot be
sent (no relay, or the relay's queue is full) is dropped and counted, and WireGuard and TCP
inside recover it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import cast

from prometheus_client import Counter

from libs.contracts.bounds import FALLBACK_QUEUE_BYTES
from libs.contracts.relay import RelayDoor, RelayRecord, member_door
from libs.relayproto import Message
from libs.relayproto.client import RelayClient
from libs.runtime.tasks import TaskSet
from services.agent.relayed.homing import RelayHome

log = logging.getLogger("nodus.agent.fallback")

FALLBACK_BYTES = Counter(
    "nodus_agent_fallback_bytes_total",
    "WireGuard bytes a Direct member's pairs sent or received through the relays",
    ["node", "direction"],
)
FALLBACK_DROPS = Counter(
    "nodus_agent_fallback_drops_total",
    "WireGuard datagrams for the relays dropped (no relay up, or its queue full)",
    ["node"],
)
QUEUE_LIMIT = FALLBACK_QUEUE_BYTES  # queued to the relay before datagrams are dropped


@dataclass
class _Bridge(asyncio.DatagramProtocol):
    fallback: RelayFallback
    key: bytes  # the peer's WireGuard key
    transport: asyncio.DatagramTransport | None = None
    wireguard: tuple[str, int] = ("127.0.0.1", 0)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | object, ...]) -> None:
        self.fallback.send(self.key, data)

    def error_received(self, exc: Exception) -> None:  # WireGuard not listening for a moment
        log.debug("fallback socket: %s", exc)


class RelayFallback:
    def __init__(
        self,
        node: str,
        gang: str,
        epoch: int,
        wg_private: bytes,
        wg_public: bytes,
        relays: list[RelayDoor],
        wireguard_port: int,
    ) -> None:
        self.node = node
        self.wireguard_port = wireguard_port
        self._gang, self._epoch = gang, epoch
        self._keys = wg_private, wg_public
        # Datagrams: nothing to resend when the home relay changes (WireGuard and TCP do).
        self.relays = RelayHome(node, [self.client_for(door) for door in relays], lambda: None)
        self.bridges: dict[bytes, _Bridge] = {}
        self._tasks = TaskSet("relay fallback", log)
        self._sent = FALLBACK_BYTES.labels(node, "sent")
        self._got = FALLBACK_BYTES.labels(node, "received")
        self._drops = FALLBACK_DROPS.labels(node)

    def client_for(self, relay: RelayDoor | RelayRecord) -> RelayClient:
        """A connection to `relay` (not yet dialled) carrying this member's pairs."""
        name, address, key = member_door(relay) if isinstance(relay, RelayRecord) else relay
        return RelayClient(
            name,
            address,
            self._gang,
            self._epoch,
            self.node,
            *self._keys,
            self._received,
            route_key=key,
        )

    @property
    def home(self) -> RelayClient | None:
        return self.relays.home

    @property
    def path(self) -> str:
        return self.relays.path

    async def start(self) -> None:
        self.relays.keep(self._tasks)

    async def stop(self) -> None:
        self.relays.close()
        await self._tasks.close()
        for bridge in self.bridges.values():
            if bridge.transport is not None:
                bridge.transport.close()
        self.bridges.clear()

    async def endpoint(self, key: bytes) -> str:
        """The loopback address that stands in for the peer with WireGuard key `key`."""
        bridge = self.bridges.get(key)
        if bridge is None:
            bridge = _Bridge(self, key, wireguard=("127.0.0.1", self.wireguard_port))
            await asyncio.get_running_loop().create_datagram_endpoint(
                lambda: bridge, local_addr=("127.0.0.1", 0)
            )
            self.bridges[key] = bridge
        assert bridge.transport is not None
        host, port = bridge.transport.get_extra_info("sockname")[:2]
        return f"{host}:{port}"

    def send(self, key: bytes, datagram: bytes) -> None:
        home = self.home
        if home is None or home.backlog() > QUEUE_LIMIT or not home.send_now(key, datagram):
            self._drops.inc()
            return
        self._sent.inc(len(datagram))

    def _received(self, src: bytes, message: Message) -> None:
        bridge = self.bridges.get(src)
        if bridge is None or bridge.transport is None:
            return  # a peer of the epoch this member has no pair with yet
        self._got.inc(len(message))
        bridge.transport.sendto(message, bridge.wireguard)

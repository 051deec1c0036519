"""Fixtures of the integration tests: two meshed relays with member clients speaking the relay
protocol, and a Relayed gang in one process (placer, two meshed relays, two agents on a real
bus)."""

from __future__ import annotations

import asyncio
import base64
import os
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import timedelta

import pytest
from prometheus_client import REGISTRY

from libs.bus import Bus
from libs.bus.server import free_port
from libs.client.client import Client
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.bounds import derive
from libs.contracts.epochs import Epoch, EpochMember
from libs.contracts.jobs import PathClass
from libs.contracts.relay import Member, RelayDoor
from libs.relayproto import x25519_public
from libs.relayproto.client import RelayClient
from services.agent.agent import Agent
from services.relay.relay import Relay
from tests.conftest import StartPlacer, eventually
from tests.factories import job, machine

MESH_KEY = b"m" * 32
L4 = {"count": 1, "backend": "cuda", "model": "L4"}


async def meshed_relays(bus: Bus, names_: tuple[str, str] = ("relay-0", "relay-1")) -> list[Relay]:
    """Two relays meshed with each other, started; once this returns, each has its link to the
    other up and knows who is homed there. Each is given both addresses, its own included,
    as relays sharing one relay.env are."""
    ports = [free_port(), free_port()]
    relays = [
        Relay(
            bus,
            names_[i],
            ["eu-central", "us-east"][i],
            ("127.0.0.1", ports[i]),
            [f"127.0.0.1:{port}" for port in ports],
            MESH_KEY,
        )
        for i in range(2)
    ]
    for relay in relays:
        await relay.start()
    for _ in range(100):
        if all(any(p.conn for p in r.mesh.peers.values()) and r.mesh.remote for r in relays):
            break
        await asyncio.sleep(0.05)
    return relays


@dataclass
class Gang:
    relays: list[Relay]
    agents: list[Agent]
    socks: list[tuple[str, int]]
    addresses: list[str]


@pytest.fixture
async def gang(bus: Bus, start_placer: StartPlacer) -> AsyncIterator[Gang]:
    relays = await meshed_relays(bus)
    socks = [("127.0.0.1", free_port()), ("127.0.0.1", free_port())]
    addresses = ["127.0.1.21", "127.0.1.22"]
    agents = [
        Agent(
            bus,
            machine(
                "vast-a",
                provider="vast",
                offering="container",
                address=addresses[0],
                accelerators=L4,
            ),
            heartbeat_seconds=0.5,
            socks_endpoint=f"{socks[0][0]}:{socks[0][1]}",
        ),
        Agent(
            bus,
            machine("lam-b", provider="lambda", address=addresses[1], accelerators=L4),
            heartbeat_seconds=0.5,
            socks_endpoint=f"{socks[1][0]}:{socks[1][1]}",
        ),
    ]
    for agent in agents:
        await agent.start()
    await start_placer()
    await Client(bus).apply(
        job(
            "rl",
            org="acme",
            accelerators={"model": "L4"},
            distributed={"members": 2, "transport": "Auto"},
        )
    )

    async def tunnels_up() -> bool:
        return all(
            a.relayed and all(r.socks is not None for r in a.relayed.values()) for a in agents
        )

    await eventually(tunnels_up, timeout=20)
    yield Gang(relays, agents, socks, addresses)
    for agent in agents:
        await agent.stop()
    for relay in relays:
        await relay.stop()


def wg_shaped(size: int, fill: int = 0x41) -> bytes:
    """A transport-shaped message (type 4, 16-byte header, padded body): what relays accept."""
    body = (size + 15) // 16 * 16
    return b"\x04\x00\x00\x00" + bytes(12) + bytes([fill]) * body + bytes(16)


class Node:
    def __init__(self, gang: str, epoch: int, name: str) -> None:
        self.gang, self.epoch, self.name = gang, epoch, name
        self.private = os.urandom(32)
        self.public = x25519_public(self.private)
        self.inbox: asyncio.Queue[tuple[bytes, bytes]] = asyncio.Queue()

    def client(self, relay: Relay) -> RelayClient:
        return self.dial((relay.name, relay.address, None))

    def dial(self, door: RelayDoor) -> RelayClient:
        """A client of the relay at `door` (`member_door` of its record)."""
        name, address, key = door
        return RelayClient(
            name,
            address,
            self.gang,
            self.epoch,
            self.name,
            self.private,
            self.public,
            lambda src, msg: self.inbox.put_nowait((src, bytes(msg))),
            takes_totals=True,
            route_key=key,
        )


async def known(relays: tuple[Relay, Relay], *nodes: Node) -> None:
    """Wait until both relays have read the nodes' member records."""
    for _ in range(200):
        if all(r.membership.identity(n.public) is not None for r in relays for n in nodes):
            return
        await asyncio.sleep(0.02)
    raise AssertionError("relays never saw the member records")


async def enrol(bus: Bus, gang: str, epoch: int, nodes: list[Node]) -> None:
    t = now()
    await bus.bucket(names.BUCKET_EPOCHS, Epoch).put(
        names.epoch_key(gang, epoch),
        Epoch(
            gang=gang,
            epoch=epoch,
            path=PathClass.RELAYED,
            mesh_id="m" * 32,
            verify_key="v",
            members=[
                EpochMember(
                    rank=i,
                    node=n.name,
                    address=f"10.0.0.{i + 1}",
                    interface="eth0",
                    devices=[],
                    env={},
                )
                for i, n in enumerate(nodes)
            ],
            bounds=derive(PathClass.RELAYED, len(nodes)),
            created_time=t,
            join_keys_expire_time=t + timedelta(minutes=15),
            placed_by="test",
        ),
    )
    for rank, node in enumerate(nodes):
        await bus.bucket(names.BUCKET_MEMBERS, Member).put(
            names.member_key(gang, epoch, node.name),
            Member(
                gang=gang,
                epoch=epoch,
                node=node.name,
                rank=rank,
                address=f"10.0.0.{rank + 1}",
                wg_public_key=base64.b64encode(node.public).decode(),
                joined_time=t,
            ),
        )


@pytest.fixture
async def relays(bus: Bus) -> AsyncIterator[tuple[Relay, Relay]]:
    first, second = await meshed_relays(bus)
    yield first, second
    for relay in (first, second):
        await relay.stop()


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def counted(name: str, value: float, **labels: str) -> None:
    for _ in range(250):
        if metric(name, **labels) >= value:
            assert metric(name, **labels) == value
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{name}{labels} never reached {value}")


LIVE: list[tuple[RelayClient, asyncio.Task[None]]] = []  # a dropped client would close


@pytest.fixture(autouse=True)
def _live_clients() -> Iterator[None]:
    yield
    LIVE.clear()


async def connected(node: Node, relay: Relay) -> RelayClient:
    client = node.client(relay)
    await client.connect()
    LIVE.append((client, asyncio.get_running_loop().create_task(client.run())))
    return client

"""The agent is a reconcile loop (O4), on real agent processes: one started with an epoch already
in the bus that it does not run (placed while it was down) joins it; its dataplane, which cannot
start (the SOCKS5 port it must listen on is taken), is tried again with a growing pause and
reported in the node's status (`nodus get nodes`) until it starts, and the gang's tunnel then
carries a connection."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from libs.bus import Bus
from libs.bus.server import NatsServer
from libs.client.client import Client
from libs.contracts import names
from libs.contracts.epochs import JoinKeyGrant
from libs.contracts.fleet import NodeRecord
from services.relay.relay import Relay
from tests.conftest import StartPlacer, eventually
from tests.e2e.nodus_cli import nodus_on
from tests.factories import job
from tests.integration.agent_daemons import (
    AgentDaemon,
    Stream,
    agent_daemons,
    end_gang,
    joined,
)
from tests.integration.conftest import meshed_relays

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
async def daemons(
    bus: Bus, nats_server: NatsServer, start_placer: StartPlacer, tmp_path: Path
) -> AsyncIterator[list[AgentDaemon]]:
    relays: list[Relay] = await meshed_relays(bus)
    started = await agent_daemons(nats_server, tmp_path, "cv", 71)
    await start_placer()
    yield started
    await end_gang(bus, "cv", started, relays)


def get_nodes(url: str, *flags: str) -> str:
    return nodus_on(url, "get", "nodes", *flags).stdout


async def test_an_agent_converges_to_an_epoch_placed_while_it_was_down_and_reports_what_fails(
    bus: Bus, nats_server: NatsServer, daemons: list[AgentDaemon]
) -> None:
    container, vm = daemons
    nodes = bus.bucket(names.BUCKET_NODES, NodeRecord)

    async def registered() -> bool:
        return all([await nodes.get(d.node) for d in daemons])

    await eventually(registered, timeout=30)
    vm.signal(signal.SIGTERM)  # down; its last heartbeat is still fresh for the placer
    taken = socket.socket()
    taken.bind(vm.socks)  # the port its dataplane must listen on
    taken.listen()
    try:
        await Client(bus).apply(
            job(
                "cv",
                org="acme",
                command=["sleep", "3600"],
                accelerators={"model": "L4"},
                distributed={"members": 2, "transport": "Auto"},
            )
        )
        grants = bus.bucket(names.BUCKET_JOINKEYS, JoinKeyGrant)

        async def granted() -> bool:
            return bool(await grants.snapshot(f"{vm.node}.>"))

        await eventually(granted, timeout=20)
        vm.start()  # an epoch in the bus it does not run: it joins it

        async def failing() -> bool:
            listed = json.loads(await asyncio.to_thread(get_nodes, nats_server.url, "-o", "json"))
            mine = next(n for n in listed if n["inventory"]["node"] == vm.node)
            return bool(mine["health"] and mine["health"].get("failing"))

        await eventually(failing, timeout=30)
        shown = await asyncio.to_thread(get_nodes, nats_server.url)
        assert "Ready,Failing" in shown, shown
        said = [line for line in shown.splitlines() if line.startswith(f"{vm.node}: ")]
        assert said and "acme.cv epoch 1: the dataplane did not start" in said[0], shown
        assert "Address already in use" in said[0] or "address already in use" in said[0], said
        # It keeps trying: two tries at least while the port stays taken.
        deadline = time.monotonic() + 20
        while "2 tries" not in said[0] and "3 tries" not in said[0]:
            assert time.monotonic() < deadline, said
            await asyncio.sleep(0.5)
            shown = await asyncio.to_thread(get_nodes, nats_server.url)
            said = [line for line in shown.splitlines() if line.startswith(f"{vm.node}: ")] or [""]
    finally:
        taken.close()

    async def homed() -> bool:
        return any(e.relay for e in await joined(bus, vm.node))

    await eventually(homed, timeout=40)  # the next try starts it

    async def quiet() -> bool:
        listed = json.loads(await asyncio.to_thread(get_nodes, nats_server.url, "-o", "json"))
        mine = next(n for n in listed if n["inventory"]["node"] == vm.node)
        return mine["health"] is not None and not mine["health"].get("failing")

    await eventually(quiet, timeout=10)
    assert "Failing" not in await asyncio.to_thread(get_nodes, nats_server.url)

    # The gang's tunnel carries a connection from one member to the other.
    stream = Stream(container.socks, vm.address)
    await stream.start()
    try:

        async def echoed() -> bool:
            return stream.received >= 20

        await eventually(echoed, timeout=20)
    finally:
        await stream.close()

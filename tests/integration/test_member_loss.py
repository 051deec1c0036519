"""Losing a member during the run (R16's gang side, G9): its epoch is fenced first, its ranks
on the surviving members stop, and the gang runs again in a new epoch without it."""

from __future__ import annotations

import sys
from pathlib import Path

import msgspec

from libs.bus import Bus
from libs.bus.server import NatsServer
from libs.client.client import Client
from libs.contracts import names
from libs.contracts.epochs import Epoch, JoinKeyGrant
from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.jobs import ConditionType, Phase
from libs.contracts.lifecycle import RankStatus
from libs.contracts.placer import PlacerConfig
from services.agent.agent import Agent
from services.runner.service import Runner
from tests.conftest import StartPlacer, eventually
from tests.factories import job, machine


async def test_a_lost_member_fences_the_epoch_and_the_gang_runs_again_without_it(
    bus: Bus, start_placer: StartPlacer, placer_config: PlacerConfig, tmp_path: Path
) -> None:
    vms = [
        machine(
            name, address=f"10.0.8.{i}", privateNetwork="vpc", privateAddress=f"127.0.2.{60 + i}"
        )
        for i, name in enumerate(["m-a", "m-b", "m-c"])
    ]
    agents = {
        m.name: Agent(bus, m, heartbeat_seconds=0.3, state_dir=tmp_path / m.name) for m in vms
    }
    for agent in agents.values():
        await agent.start()
    await start_placer(msgspec.structs.replace(placer_config, heartbeat_timeout_seconds=1.5))
    runner = Runner(bus, "runner-test", sample_seconds=0.2, readiness_seconds=5)
    await runner.start()
    client = Client(bus)
    try:
        # A long-running command: the gang is Running when a member dies.
        await client.apply(
            job(
                "long",
                org="acme",
                command=[sys.executable, "-c", "import time; time.sleep(120)"],
                distributed={"members": 2, "network": "Colocated"},
            )
        )

        async def running(epoch: int) -> bool:
            current = await client.get_job("long")
            return current.status.phase is Phase.RUNNING and current.status.epoch == epoch

        await eventually(lambda: running(1), timeout=30)
        first = await client.get_job("long")
        assert first.status.gang is not None
        members = [m.node for m in first.status.gang.members]
        lost, survivor = members[0], members[1]
        await agents.pop(lost).stop()  # the machine is gone: no more heartbeats

        await eventually(lambda: running(2), timeout=30)
        second = await client.get_job("long")
        assert second.status.gang is not None
        assert lost not in {m.node for m in second.status.gang.members}
        assert lost in second.status.avoid
        events = [(e.kind, e.message) for e in await client.events(second)]
        assert any(kind == "MemberLost" and lost in message for kind, message in events)
        # The old epoch was fenced before the new one was placed; its keys are gone ...
        old = await bus.bucket(names.BUCKET_EPOCHS, Epoch).get(names.epoch_key("acme.long", 1))
        assert old is not None and old.value.fenced
        for node in members:
            assert (
                await bus.bucket(names.BUCKET_JOINKEYS, JoinKeyGrant).get(
                    names.joinkey_key(node, "acme.long", 1)
                )
                is None
            )
        # ... and the survivor's rank of epoch 1 was stopped, not left running.
        old_ranks = await bus.bucket(names.BUCKET_RANKS, RankStatus).snapshot("acme.long.1.>")
        survivor_rank = [r.value for r in old_ranks.values() if r.value.node == survivor]
        assert survivor_rank and survivor_rank[0].state == "Stopped"
        # A message stamped with the old epoch is refused where it arrives (C2).
        grant = await bus.bucket(names.BUCKET_JOINKEYS, JoinKeyGrant).get(
            names.joinkey_key(survivor, "acme.long", 2)
        )
        assert grant is not None
        ready = second.condition(ConditionType.GANG_READY)
        assert ready is not None and ready.status == "True"
        try:
            await agents[survivor].gangs._member("acme.long", 1)
        except NodusError as error:
            assert error.code is ErrorCode.STALE_EPOCH
        else:
            raise AssertionError("the fenced epoch was accepted")
    finally:
        await runner.stop()
        for agent in agents.values():
            await agent.stop()


async def test_a_gang_with_no_other_machine_goes_back_to_the_one_it_lost_once_it_is_back(
    bus: Bus,
    nats_server: NatsServer,
    start_placer: StartPlacer,
    placer_config: PlacerConfig,
    tmp_path: Path,
) -> None:
    """Two machines, a gang of two: a lost member is avoided while another machine could take
    its place; here none can, so once the machine is back (healthy, free) the gang runs on it
    again rather than waiting Pending forever."""
    vms = [
        machine(
            name, address=f"10.0.9.{i}", privateNetwork="vpc", privateAddress=f"127.0.2.{70 + i}"
        )
        for i, name in enumerate(["n-a", "n-b"])
    ]
    # Each agent on a connection of its own: a machine that goes away takes its endpoints along.
    buses = [await Bus.open(nats_server.url, name=m.name, buckets=names.ALL_BUCKETS) for m in vms]
    agents = {
        m.name: Agent(own, m, heartbeat_seconds=0.3, state_dir=tmp_path / m.name)
        for m, own in zip(vms, buses, strict=True)
    }
    for agent in agents.values():
        await agent.start()
    await start_placer(msgspec.structs.replace(placer_config, heartbeat_timeout_seconds=1.5))
    runner = Runner(bus, "runner-test", sample_seconds=0.2, readiness_seconds=5)
    await runner.start()
    client = Client(bus)
    try:
        await client.apply(
            job(
                "pair",
                org="acme",
                command=[sys.executable, "-c", "import time; time.sleep(120)"],
                distributed={"members": 2, "network": "Colocated"},
            )
        )

        async def phase(epoch: int, wanted: Phase) -> bool:
            current = await client.get_job("pair")
            return current.status.phase is wanted and current.status.epoch == epoch

        await eventually(lambda: phase(1, Phase.RUNNING), timeout=30)
        lost = "n-a"
        await agents.pop(lost).stop()
        await buses[0].close()
        await eventually(lambda: phase(1, Phase.PENDING), timeout=30)
        buses[0] = await Bus.open(nats_server.url, name="n-a-again", buckets=names.ALL_BUCKETS)
        agents[lost] = Agent(buses[0], vms[0], heartbeat_seconds=0.3, state_dir=tmp_path / lost)
        await agents[lost].start()
        await eventually(lambda: phase(2, Phase.RUNNING), timeout=30)
        second = await client.get_job("pair")
        assert second.status.gang is not None
        assert {m.node for m in second.status.gang.members} == {"n-a", "n-b"}
        assert lost in second.status.avoid  # still said: it was avoided while it could be
        assert second.status.lost == [lost]  # lost, not a probe's suspect: it may come back
    finally:
        await runner.stop()
        for agent in agents.values():
            await agent.stop()
        for own in buses:
            await own.close()

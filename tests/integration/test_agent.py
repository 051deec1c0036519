"""The agent on a real bus: registration with inventory, version and capabilities (T1, C6),
heartbeats, requests addressed to its node (C1), and joining an epoch with a single-use key (G9)."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from libs.bus import Bus
from libs.client.client import Client
from libs.contracts import names
from libs.contracts.api import NodeInfoReply, NodeInfoRequest
from libs.contracts.base import now
from libs.contracts.epochs import Epoch, JoinKeyGrant, JoinRedemption
from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.fleet import NodeHealth, NodeRecord
from libs.contracts.jobs import Phase
from libs.contracts.lifecycle import JoinedEpochsReply, JoinedEpochsRequest, RankProcess, RankStatus
from services.agent.agent import Agent
from services.agent.boot import new_lab_boot
from tests.conftest import StartPlacer, eventually
from tests.factories import job, machine


@pytest.fixture
async def agents(bus: Bus) -> AsyncIterator[list[Agent]]:
    started = [
        Agent(bus, machine("aws-a", address="10.0.0.1"), heartbeat_seconds=0.1),
        Agent(
            bus, machine("vast-a", offering="container", address="10.0.0.2"), heartbeat_seconds=0.1
        ),
    ]
    for agent in started:
        await agent.start()
    yield started
    for agent in started:
        await agent.stop()


async def test_agents_register_inventory_version_and_capabilities(
    bus: Bus, agents: list[Agent]
) -> None:
    records = await bus.bucket(names.BUCKET_NODES, NodeRecord).snapshot()
    assert set(records) == {"aws-a", "vast-a"}
    vm, container = records["aws-a"].value, records["vast-a"].value
    assert vm.agent_version == container.agent_version == "0.1.0"
    assert (
        "wireguard-device" in vm.capabilities and "wireguard-device" not in container.capabilities
    )
    assert "join-epoch" in container.capabilities
    assert vm.inventory.accelerators.devices[0].name == "CUDA0"
    assert vm.inventory.network_namespace  # C4 needs it
    health = bus.bucket(names.BUCKET_HEALTH, NodeHealth)
    first = await health.get("aws-a")
    assert first is not None

    async def beat_again() -> bool:
        later = await health.get("aws-a")
        return later is not None and later.value.heartbeat_time > first.value.heartbeat_time

    await eventually(beat_again, timeout=5)


async def test_requests_reach_the_named_node_and_a_missing_agent_is_an_error(
    bus: Bus, agents: list[Agent]
) -> None:
    reply = await bus.request(
        names.node_request("vast-a", names.AgentVerb.INFO), NodeInfoRequest(), NodeInfoReply
    )
    assert reply.node.inventory.node == "vast-a"
    await agents[1].stop()
    with pytest.raises(NodusError) as missing:
        await bus.request(
            names.node_request("no-such-node", names.AgentVerb.INFO),
            NodeInfoRequest(),
            NodeInfoReply,
        )
    assert missing.value.code is ErrorCode.NO_RESPONDERS


async def test_agents_join_their_epoch_once(
    bus: Bus, agents: list[Agent], start_placer: StartPlacer
) -> None:
    await start_placer()
    client = Client(bus)
    await client.apply(job("rl", org="acme", distributed={"members": 2, "transport": "Auto"}))
    placed = await client.get_job("rl")

    async def joined_both() -> bool:
        replies = [
            await bus.request(
                names.node_request(n, names.AgentVerb.EPOCHS),
                JoinedEpochsRequest(),
                JoinedEpochsReply,
            )
            for n in ("aws-a", "vast-a")
        ]
        return all(len(r.epochs) == 1 for r in replies)

    await eventually(joined_both)
    placed = await client.get_job("rl")
    assert placed.status.phase is Phase.PLACED
    redeemed = await bus.bucket(names.BUCKET_REDEEMED, JoinRedemption).snapshot()
    assert {r.value.node for r in redeemed.values()} == {"aws-a", "vast-a"}
    # Replaying a used key: the agent refuses it (single use).
    grants = bus.bucket(names.BUCKET_JOINKEYS, JoinKeyGrant)
    key = names.joinkey_key("aws-a", "acme.rl", 1)
    grant = await grants.get(key)
    assert grant is not None
    agent = agents[0]
    with pytest.raises(NodusError) as replay:
        await agent._join(grant.value)
    assert replay.value.code is ErrorCode.CONFLICT and "already used" in replay.value.message
    # After delete the epoch is fenced: the agent leaves it, and its key is refused.
    await client.delete("rl")

    async def left() -> bool:
        reply = await bus.request(
            names.node_request("aws-a", names.AgentVerb.EPOCHS),
            JoinedEpochsRequest(),
            JoinedEpochsReply,
        )
        return not reply.epochs

    await eventually(left)
    epoch = await bus.bucket(names.BUCKET_EPOCHS, Epoch).get(names.epoch_key("acme.rl", 1))
    assert epoch is not None and epoch.value.fenced
    with pytest.raises(NodusError) as fenced:
        await agent._join(grant.value)
    # The agent reads no epochs (S1): the key, used once, is what refuses it now; a fenced
    # epoch's keys are gone.
    assert fenced.value.code in (ErrorCode.STALE_EPOCH, ErrorCode.CONFLICT)
    assert not await bus.bucket(names.BUCKET_JOINKEYS, JoinKeyGrant).snapshot("aws-a.>")
    assert now() < epoch.value.join_keys_expire_time


def _die(agent: Agent) -> None:
    """The agent process is SIGKILLed: its tasks end, nothing is stopped."""
    for rank in agent.gangs.runner.running.values():
        if rank.waiter is not None:
            rank.waiter.cancel()
    for task in agent._tasks:
        task.cancel()


async def test_an_agent_started_again_on_the_same_boot_adopts_its_ranks_and_reports_their_exit(
    bus: Bus, tmp_path: Path
) -> None:
    """An agent upgrade or crash is not a reboot (O4): the next agent on the same boot finds
    the ranks still running, leaves them be, and reports the exit code they end with, even one
    that ended while no agent ran."""
    first = Agent(bus, machine("aws-r", address="10.0.0.9"), state_dir=tmp_path)
    await first.start()
    marker = tmp_path / "go"
    await first.gangs.runner.launch(
        "acme.long", 1, 0, ["sh", "-c", f"while [ ! -e {marker} ]; do sleep 0.05; done; exit 3"], {}
    )
    await first.gangs.runner.launch("acme.short", 1, 0, ["sh", "-c", "exit 5"], {})
    keeper = first.gangs.runner.running[names.rank_key("acme.long", 1, 0, "aws-r")].pid
    short = first.gangs.runner.running[names.rank_key("acme.short", 1, 0, "aws-r")]
    assert short.process is not None
    await short.process.wait()  # it ends while no agent watches: its keeper keeps the code
    _die(first)

    second = Agent(bus, machine("aws-r", address="10.0.0.9"), state_dir=tmp_path)
    assert second.boot_id == first.boot_id
    await second.start()
    try:
        ranks = bus.bucket(names.BUCKET_RANKS, RankStatus)
        assert os.getpgid(keeper) == keeper  # the rank's keeper still runs, untouched
        stored = await ranks.get("acme.long.1.0.aws-r")
        assert stored is not None and stored.value.state == "Running"
        marker.touch()

        async def long_exited() -> bool:
            stored = await ranks.get("acme.long.1.0.aws-r")
            return stored is not None and stored.value.state == "Exited"

        await eventually(long_exited)
        for key, code in (("acme.long.1.0.aws-r", 3), ("acme.short.1.0.aws-r", 5)):
            stored = await ranks.get(key)
            assert stored is not None, key
            assert (stored.value.state, stored.value.exit_code) == ("Exited", code), key
        assert not list((tmp_path / "logs").glob("*.pid"))
    finally:
        await second.stop()


async def test_an_agent_of_a_new_lab_boot_stops_the_ranks_of_the_previous_boot_and_no_stranger(
    bus: Bus, tmp_path: Path
) -> None:
    """The lab's reboot (a new boot id in the machine's directory) leaves the old boot's ranks
    alive on the shared kernel: the next agent kills them and records them Stopped; a
    remembered pid that another process has taken since is left alone."""
    first = Agent(bus, machine("aws-r", address="10.0.0.9"), state_dir=tmp_path)
    await first.start()
    await first.gangs.runner.launch("acme.sleepy", 1, 0, ["sleep", "60"], {})
    rank = first.gangs.runner.running[names.rank_key("acme.sleepy", 1, 0, "aws-r")]
    assert rank.process is not None
    _die(first)
    # A record whose pid is now another process (this test's): not the rank.
    stranger = RankProcess(
        status=RankStatus(
            gang="acme.other", epoch=3, rank=1, node="aws-r", state="Running", started_time=now()
        ),
        pid=os.getpid(),
        start_ticks=1,
        boot_id=first.boot_id,
    )
    (tmp_path / "logs" / "acme.other.3.1.aws-r.pid").write_bytes(msgspec.json.encode(stranger))
    new_lab_boot(tmp_path)

    second = Agent(bus, machine("aws-r", address="10.0.0.9"), state_dir=tmp_path)
    assert second.boot_id != first.boot_id
    await second.start()
    try:
        assert (await rank.process.wait()) == -signal.SIGKILL
        ranks = bus.bucket(names.BUCKET_RANKS, RankStatus)
        for key in ("acme.sleepy.1.0.aws-r", "acme.other.3.1.aws-r"):
            stored = await ranks.get(key)
            assert stored is not None and stored.value.state == "Stopped", (key, stored)
            assert stored.value.ended_time is not None
        assert not list((tmp_path / "logs").glob("*.pid"))
    finally:
        await second.stop()


async def test_a_read_of_the_join_keys_that_comes_back_empty_leaves_no_running_epoch(
    bus: Bus, agents: list[Agent], start_placer: StartPlacer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read of the whole bucket during a server's failover came back empty, and the agent
    left a running gang whose key was there (chaos seed 789536): it asks the key itself first."""
    await start_placer()
    client = Client(bus)
    await client.apply(job("kept", org="acme", distributed={"members": 2, "transport": "Auto"}))
    agent = agents[0]

    async def epochs() -> int:
        reply = await bus.request(
            names.node_request("aws-a", names.AgentVerb.EPOCHS),
            JoinedEpochsRequest(),
            JoinedEpochsReply,
        )
        return len(reply.epochs)

    async def joined() -> bool:
        return await epochs() == 1

    await eventually(joined)

    async def nothing_read(keys: str = ">") -> dict[str, Any]:
        return {}

    monkeypatch.setattr(agent.joinkeys, "snapshot", nothing_read)
    await agent._reconcile_all()
    assert await epochs() == 1  # still running: its key is there
    await client.delete("kept")  # a key really gone is still left
    monkeypatch.undo()

    async def left() -> bool:
        return await epochs() == 0

    await eventually(left)

"""A launch that no agent answers: an agent restarting at that moment is asked again and the
job runs; one that never answers is a lost member, and the gang is placed again without it,
not failed (chaos random seed 175595 failed a job for an agent restarted under its launch). A
launch whose answer the bus lost is asked again, and the agent starts its rank once (chaos
seed 1: a rank ran and exited 0, and its job Failed with LaunchFailed: Timeout)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import msgspec
import pytest

from libs.bus import Bus
from libs.contracts import names
from libs.contracts.base import encode
from libs.contracts.jobs import ConditionType, Job, Phase
from libs.contracts.lifecycle import LaunchReply, LaunchRequest, RankStatus
from services.agent.ranks import RankRunner
from services.runner import agents
from services.runner import run as run_module
from services.runner.run import GangRun
from tests.conftest import eventually
from tests.integration.test_run_conclusion import NODES, _probing_job


async def answer_launches(bus: Bus, node: str) -> Any:
    async def reply(msg: Any) -> None:
        await msg.respond(encode(LaunchReply(started=True)))

    return await bus.nc.subscribe(names.node_request(node, names.AgentVerb.LAUNCH), cb=reply)


async def test_an_agent_back_within_the_launchs_patience_gets_its_rank(bus: Bus) -> None:
    record = await _probing_job(bus)
    await answer_launches(bus, NODES[0])
    run = GangRun(bus)
    await run.start()
    try:
        launching = asyncio.create_task(run.launch(record.key, 1))
        await asyncio.sleep(1.5)  # h-1's agent restarts meanwhile
        assert not launching.done()
        await answer_launches(bus, NODES[1])
        await asyncio.wait_for(launching, 10)
        stored = await bus.bucket(names.BUCKET_JOBS, Job).get(record.key)
        assert stored is not None and stored.value.status.phase is Phase.RUNNING
    finally:
        await run.stop()


async def test_an_agent_that_never_answers_is_a_lost_member_not_a_failed_job(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(agents, "UNANSWERED_SECONDS", 1.0)
    record = await _probing_job(bus)
    await answer_launches(bus, NODES[0])
    run = GangRun(bus)
    await run.start()
    try:
        await asyncio.wait_for(run.launch(record.key, 1), 10)
        jobs = bus.bucket(names.BUCKET_JOBS, Job)

        async def placed_again_without_it() -> bool:
            found = await jobs.get(record.key)
            return found is not None and found.value.status.phase is Phase.PENDING

        await eventually(placed_again_without_it)
        stored = await jobs.get(record.key)
        assert stored is not None
        assert NODES[1] in stored.value.status.avoid
        ready = stored.value.condition(ConditionType.GANG_READY)
        assert ready is not None and ready.reason == "MemberLost", ready
    finally:
        await run.stop()


async def test_a_launch_whose_answer_was_lost_is_asked_again_and_its_rank_starts_once(
    bus: Bus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(run_module, "LAUNCH_ANSWER_SECONDS", 1.0)
    record = await _probing_job(bus)
    await answer_launches(bus, NODES[0])
    # h-1's agent: a real RankRunner; the answer to its first launch is lost on the way back.
    ranks = RankRunner(NODES[1], bus.bucket(names.BUCKET_RANKS, RankStatus), tmp_path)
    asked: list[bool] = []

    async def launch_losing_the_first_answer(msg: Any) -> None:
        request = msgspec.json.decode(msg.data, type=LaunchRequest)
        started = await ranks.launch(request.gang, request.epoch, request.rank, ["true"], {})
        asked.append(started)
        if len(asked) > 1:
            await msg.respond(encode(LaunchReply(started=started)))

    await bus.nc.subscribe(
        names.node_request(NODES[1], names.AgentVerb.LAUNCH), cb=launch_losing_the_first_answer
    )
    run = GangRun(bus)
    await run.start()
    try:
        await asyncio.wait_for(run.launch(record.key, 1), 10)
        stored = await bus.bucket(names.BUCKET_JOBS, Job).get(record.key)
        assert stored is not None and stored.value.status.phase is Phase.RUNNING
        assert asked[:2] == [True, False], asked  # started once, "already started" after
        # The agent after this one on the machine (a restart) starts nothing either.
        again = RankRunner(NODES[1], bus.bucket(names.BUCKET_RANKS, RankStatus), tmp_path)
        assert await again.launch(record.key, 1, 1, ["true"], {}) is False
    finally:
        await run.stop()
        await ranks.stop_all()


async def test_a_member_whose_agent_stays_silent_is_reported_as_such(bus: Bus) -> None:
    started = asyncio.get_running_loop().time()
    with pytest.raises(agents.MemberSilent, match="h-9: no agent answered the launch"):
        await agents.ask(
            bus,
            "h-9",
            names.AgentVerb.LAUNCH,
            LaunchRequest(gang="a.b", epoch=1, rank=0, command=["true"]),
            LaunchReply,
            each=0.5,
            unanswered=1.5,
        )
    assert asyncio.get_running_loop().time() - started < 5

"""Runner replicas take over from one that died (R14): an epoch left Probing is probed again from
the start by exactly one other replica, and rank exits that happened while no runner was up
still conclude the job, billed once. The runner that dies is stopped without any cleanup, so
its probe record is left Running with a heartbeat that is no longer renewed; one stopped on
purpose releases its probe, taken over at once."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

from libs.bus import Bus
from libs.client.client import Client
from libs.contracts import names
from libs.contracts.jobs import ConditionType, Job, Phase
from libs.contracts.lifecycle import RankStatus
from services.agent.agent import Agent
from services.runner.service import Runner
from tests.conftest import StartPlacer, eventually
from tests.factories import job, machine

TAKEOVER = 1.0  # every replica's takeover window here (the daemons' default is 15 s)


@pytest.fixture
async def client(bus: Bus, start_placer: StartPlacer, tmp_path: Path) -> AsyncIterator[Client]:
    """Two VMs on one private network (a Private pair) with their agents, and a placer."""
    vms = [
        machine(
            name, address=f"10.0.7.{i}", privateNetwork="vpc", privateAddress=f"127.0.2.{121 + i}"
        )
        for i, name in enumerate(["t-a", "t-b"])
    ]
    agents = [Agent(bus, m, heartbeat_seconds=0.5, state_dir=tmp_path / m.name) for m in vms]
    for agent in agents:
        await agent.start()
    await start_placer()
    yield Client(bus)
    for agent in agents:
        await agent.stop()


def runner(bus: Bus, replica: str) -> Runner:
    return Runner(bus, replica, sample_seconds=1.0, readiness_seconds=5, takeover_seconds=TAKEOVER)


class JobHistory:
    """Every revision of one job, from a watch: what a bill-once check needs."""

    def __init__(self, bus: Bus, key: str) -> None:
        self.seen: list[Job] = []
        self._task = asyncio.create_task(self._watch(bus, key))

    async def _watch(self, bus: Bus, key: str) -> None:
        async for change in bus.bucket(names.BUCKET_JOBS, Job).watch(key):
            if change.value is not None:
                self.seen.append(change.value)

    def phases(self) -> list[Phase]:
        """The phases the job went through, each change of phase once."""
        phases: list[Phase] = []
        for seen in self.seen:
            if not phases or phases[-1] is not seen.status.phase:
                phases.append(seen.status.phase)
        return phases

    def bills(self) -> set[str]:
        return {str(j.status.billing) for j in self.seen if j.status.phase is Phase.SUCCEEDED}

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def wait_phase(client: Client, name: str, phase: Phase, timeout: float = 30) -> Job:
    found: list[Job] = []

    async def reached() -> bool:
        found.append(await client.get_job(name))
        return found[-1].status.phase is phase

    await eventually(reached, timeout)
    return found[-1]


def takeovers() -> float:
    return REGISTRY.get_sample_value("nodus_runner_takeovers_total") or 0.0


async def test_an_epoch_left_probing_is_taken_over_by_exactly_one_other_replica(
    bus: Bus, client: Client
) -> None:
    first = runner(bus, "runner-a")
    await first.start()
    others = [runner(bus, "runner-b"), runner(bus, "runner-c")]
    history = JobHistory(bus, "acme.taken")
    before = takeovers()
    try:
        await client.apply(
            job(
                "taken",
                org="acme",
                command=[sys.executable, "-c", "pass"],
                distributed={"members": 2, "network": "Colocated"},
            )
        )
        probing = await wait_phase(client, "taken", Phase.PROBING)
        held = await client.probe(probing)
        assert held is not None and held.prober == "runner-a" and held.state == "Running"
        for other in others:  # two replicas that will race for the takeover
            await other.start()
        await first.stop(release=False)  # dies mid-probe: the record stays Running, aging

        done = await wait_phase(client, "taken", Phase.SUCCEEDED, timeout=60)
        record = await client.probe(done)
        assert record is not None and record.state == "Qualified", record
        assert record.prober in {"runner-b", "runner-c"} and record.attempt == 2, record
        assert len(record.pairs) == 1 and record.pairs[0].ok and record.pairs[0].tcp_gbps > 0
        assert done.status.epoch == 1  # the same epoch, probed again, not placed again
        assert done.status.gang is not None and done.status.gang.probe is not None
        qualified = done.condition(ConditionType.NETWORK_QUALIFIED)
        assert qualified is not None and qualified.reason == "ProbePassed"
        assert takeovers() - before == 1  # exactly one winner
        await asyncio.sleep(0.5)  # nobody writes the job again after the end
        assert history.phases()[-3:] == [Phase.PROBING, Phase.RUNNING, Phase.SUCCEEDED]
        assert history.phases().count(Phase.SUCCEEDED) == 1
        assert len(history.bills()) == 1  # billed once
    finally:
        await history.close()
        await first.stop()
        for other in others:
            await other.stop()


async def test_ranks_that_end_while_no_runner_is_up_conclude_the_job_when_one_starts(
    bus: Bus, client: Client
) -> None:
    first = runner(bus, "runner-a")
    await first.start()
    history = JobHistory(bus, "acme.unwatched")
    later: Runner | None = None
    try:
        await client.apply(
            job(
                "unwatched",
                org="acme",
                command=[sys.executable, "-c", "import time; time.sleep(1.0)"],
                distributed={"members": 2, "network": "Colocated"},
            )
        )
        running = await wait_phase(client, "unwatched", Phase.RUNNING)
        await first.stop()
        ranks = bus.bucket(names.BUCKET_RANKS, RankStatus)

        async def exited() -> bool:
            found = list((await ranks.snapshot(f"{running.key}.1.>")).values())
            return len(found) == 2 and all(f.value.state == "Exited" for f in found)

        await eventually(exited, 20)
        await asyncio.sleep(1.0)  # the job stays Running while no runner is up
        assert (await client.get_job("unwatched")).status.phase is Phase.RUNNING

        later = runner(bus, "runner-b")
        await later.start()
        done = await wait_phase(client, "unwatched", Phase.SUCCEEDED)
        ready = done.condition(ConditionType.GANG_READY)
        assert ready is not None and ready.reason == "Completed"
        billing = done.status.billing
        assert billing is not None and billing.boot_seconds > 0
        # Billed to when the ranks ended, not to when a runner came back.
        assert 0.9 <= billing.run_seconds < 2.0, billing
        record = await client.probe(done)
        assert record is not None and record.state == "Qualified" and record.attempt == 1
        await asyncio.sleep(0.5)
        assert history.phases()[-2:] == [Phase.RUNNING, Phase.SUCCEEDED]
        assert len(history.bills()) == 1
    finally:
        await history.close()
        await first.stop()
        if later is not None:
            await later.stop()


async def test_a_runner_stopped_on_purpose_hands_its_probe_over_at_once(
    bus: Bus, client: Client
) -> None:
    """An upgrade or a drain stops a replica mid-probe: it releases what it holds, and another
    replica probes the epoch again without waiting out a (here 60 s) takeover window."""
    window = 60.0
    first = Runner(
        bus, "runner-a", sample_seconds=1.0, readiness_seconds=5, takeover_seconds=window
    )
    second = Runner(
        bus, "runner-b", sample_seconds=1.0, readiness_seconds=5, takeover_seconds=window
    )
    await first.start()
    try:
        await client.apply(
            job(
                "handed",
                org="acme",
                command=[sys.executable, "-c", "pass"],
                distributed={"members": 2, "network": "Colocated"},
            )
        )
        await wait_phase(client, "handed", Phase.PROBING)
        await second.start()
        await first.stop()
        done = await wait_phase(client, "handed", Phase.SUCCEEDED, timeout=window / 2)
        record = await client.probe(done)
        assert record is not None and record.prober == "runner-b" and record.attempt == 2, record
        assert not record.released
    finally:
        await first.stop()
        await second.stop()

"""The runner SIGKILLed and started again, as systemd's Restart= would (R14), with real
processes (`LocalSystem`): killed while the gang is Probing, and again while its ranks run,
nothing is lost: the epoch's probe is taken over and run again from the start, and the ranks
that ended while no runner was up conclude the job, billed once."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from libs.contracts import names
from libs.contracts.jobs import ConditionType, Job, Phase
from libs.contracts.lifecycle import ProbeRecord, RankStatus
from tests.e2e.gang_system import SLEEPER, ended, local_system, vm_in_vpc, wait_job
from tests.factories import job

pytestmark = pytest.mark.slow


async def test_a_runner_killed_while_probing_and_while_running_loses_nothing(
    tmp_path: Path,
) -> None:
    """An operator restarts a runner that died (as systemd's Restart= would), under its own
    --replica name. Killed while the gang is Probing: the new process takes the epoch's probe
    record over at once (compare-and-set; same replica, another instance) and probes the epoch
    again from the start. Killed again while the ranks run, and kept down until they have all
    ended: the new process sees their exits in the ranks bucket and concludes the job, billed
    for the run up to the ranks' end, once."""
    machines = [vm_in_vpc("h100-k", 97), vm_in_vpc("h100-l", 98)]
    # A 3 s throughput sample keeps the gang Probing long enough to be caught there.
    async with local_system(tmp_path, machines, sample_seconds=3.0) as (system, client, bus):
        revisions: list[Job] = []

        async def record_revisions() -> None:
            async for change in bus.bucket(names.BUCKET_JOBS, Job).watch("acme.resilient"):
                if change.value is not None:
                    revisions.append(change.value)

        watcher = asyncio.create_task(record_revisions())
        await client.apply(
            job(
                "resilient",
                org="acme",
                command=[sys.executable, "-c", SLEEPER, "2"],
                accelerators={"model": "H100"},
                distributed={"members": 2, "network": "Colocated", "transport": "Direct"},
            )
        )
        runners = bus.bucket(names.BUCKET_PROBES, ProbeRecord)
        await wait_job(
            client, system, "resilient", lambda j: j.status.phase is Phase.PROBING, 60, "Probing"
        )
        runner = system.child("runner-0")
        os.kill(runner.process.pid, signal.SIGKILL)
        runner.process.wait(timeout=10)
        left = await runners.get("acme.resilient.1")
        assert left is not None and left.value.state == "Running", left
        assert (await client.get_job("resilient")).status.phase is Phase.PROBING
        system.restart("runner-0")

        running = await wait_job(
            client, system, "resilient", lambda j: j.status.phase is Phase.RUNNING, 60, "Running"
        )
        record = await client.probe(running)
        assert record is not None and record.state == "Qualified", record
        assert record.prober == "runner-0" and record.attempt == 2, record
        assert record.instance != left.value.instance
        assert len(record.pairs) == 1 and record.pairs[0].ok and record.pairs[0].tcp_gbps > 0
        assert record.started_time > left.value.started_time  # probed again from the start
        probe = running.status.gang.probe if running.status.gang else None
        assert probe is not None and probe.tcp_gbps == record.pairs[0].tcp_gbps

        runner = system.child("runner-0")
        os.kill(runner.process.pid, signal.SIGKILL)
        runner.process.wait(timeout=10)
        ranks = bus.bucket(names.BUCKET_RANKS, RankStatus)
        deadline = time.monotonic() + 30
        ended_ranks: list[RankStatus] = []
        while time.monotonic() < deadline and len(ended_ranks) < 2:
            found = (await ranks.snapshot("acme.resilient.1.>")).values()
            ended_ranks = [f.value for f in found if f.value.state == "Exited"]
            await asyncio.sleep(0.2)
        assert len(ended_ranks) == 2, "the ranks did not end while the runner was down"
        await asyncio.sleep(1.0)
        assert (await client.get_job("resilient")).status.phase is Phase.RUNNING
        system.restart("runner-0")

        done = await wait_job(client, system, "resilient", ended, 60, "the end of the run")
        assert done.status.phase is Phase.SUCCEEDED, done.status.conditions
        assert done.status.epoch == 1
        ready = done.condition(ConditionType.GANG_READY)
        assert ready is not None and ready.reason == "Completed"
        billing = done.status.billing
        assert billing is not None and billing.boot_seconds > 0
        last_end = max(r.ended_time for r in ended_ranks if r.ended_time)
        assert done.status.finished_time == last_end  # not when the runner came back
        assert 1.5 < billing.run_seconds < 4.0, billing

        await asyncio.sleep(1.0)
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        terminal = [j for j in revisions if j.status.phase in (Phase.SUCCEEDED, Phase.FAILED)]
        assert terminal, revisions
        assert {str(j.status.billing) for j in terminal} == {str(billing)}  # billed once
        phases = [j.status.phase for j in revisions]
        first_end = phases.index(Phase.SUCCEEDED)
        assert all(p is Phase.SUCCEEDED for p in phases[first_end:]), phases
        log = system.child("runner-0").log.read_text(errors="replace")
        assert "took the probe over from runner-0 (its previous run)" in log

"""A job whose ranks all exited is concluded even when no exit comes after the moment it could
be: chaos found jobs left Running for ever with every rank exited 0, their conclusion decided on
a read that a lagging replica answered (or that a bus failover cut short). The runner concludes
from the rank records its watch delivered, on each exit and again on a period."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import msgspec

from libs.bus import Bus
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.bounds import derive
from libs.contracts.epochs import Epoch, EpochMember
from libs.contracts.jobs import Job, PathClass, Phase
from libs.contracts.lifecycle import RankStatus
from services.runner.run import CONCLUDE_SWEEP_SECONDS, GangRun
from tests.conftest import eventually
from tests.factories import job

NODES = ("h-0", "h-1")


async def _probing_job(bus: Bus) -> Job:
    t = now()
    spec = job("late", org="acme")
    record = msgspec.structs.replace(
        spec, status=msgspec.structs.replace(spec.status, phase=Phase.PROBING, epoch=1)
    )
    await bus.bucket(names.BUCKET_JOBS, Job).put(record.key, record)
    members = [
        EpochMember(rank=r, node=n, address=f"10.0.0.{r + 1}", interface="eth0", devices=[], env={})
        for r, n in enumerate(NODES)
    ]
    epoch = Epoch(
        gang=record.key,
        epoch=1,
        path=PathClass.PRIVATE,
        mesh_id="m" * 32,
        verify_key="v",
        members=members,
        bounds=derive(PathClass.PRIVATE, 2),
        created_time=t,
        join_keys_expire_time=t + timedelta(minutes=15),
        placed_by="test",
    )
    await bus.bucket(names.BUCKET_EPOCHS, Epoch).put(names.epoch_key(record.key, 1), epoch)
    return record


async def test_a_job_whose_ranks_exited_before_it_said_running_is_concluded(bus: Bus) -> None:
    record = await _probing_job(bus)
    run = GangRun(bus)
    await run.start()
    try:
        ranks = bus.bucket(names.BUCKET_RANKS, RankStatus)
        for rank, node in enumerate(NODES):
            t = now()
            status = RankStatus(
                gang=record.key,
                epoch=1,
                rank=rank,
                node=node,
                state="Exited",
                started_time=t,
                exit_code=0,
                ended_time=t,
            )
            await ranks.put(names.rank_key(record.key, 1, rank, node), status)
        await asyncio.sleep(1.0)  # both exits seen while the job did not say Running yet
        jobs = bus.bucket(names.BUCKET_JOBS, Job)
        stored = await jobs.get(record.key)
        assert stored is not None and stored.value.status.phase is Phase.PROBING
        running = msgspec.structs.replace(
            stored.value, status=msgspec.structs.replace(stored.value.status, phase=Phase.RUNNING)
        )
        await jobs.put(record.key, running)  # no rank changes after this

        async def succeeded() -> bool:
            found = await jobs.get(record.key)
            return found is not None and found.value.status.phase is Phase.SUCCEEDED

        await eventually(succeeded, CONCLUDE_SWEEP_SECONDS * 3)
    finally:
        await run.stop()

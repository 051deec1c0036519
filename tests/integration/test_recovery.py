"""A placer that dies leaves nothing stuck: another replica takes over its Pending jobs, and
leases a crashed commit left without a persisted epoch are released."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from libs.bus import Bus
from libs.client.client import Client
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.epochs import Lease
from libs.contracts.jobs import ConditionType, Job, JobStatus, Phase
from tests.conftest import StartPlacer, eventually
from tests.factories import job, machine, node_record, register


async def test_a_replica_takes_over_pending_jobs_of_a_placer_that_died(
    bus: Bus, start_placer: StartPlacer
) -> None:
    await register(bus, [node_record(machine(f"m{i}", address=f"10.0.0.{i}")) for i in (1, 2)])
    # placer-a admitted the job (the record it writes at admission), then died before placing.
    admitted = job("orphan")
    admitted.status = JobStatus(created_time=now(), placed_by="placer-a")
    jobs = bus.bucket(names.BUCKET_JOBS, Job)
    await jobs.create(admitted.key, admitted)
    await start_placer(replica="placer-b")

    async def placed_by_b() -> bool:
        current = await jobs.get("acme.orphan")
        return (
            current is not None
            and current.value.status.phase is Phase.PLACED
            and current.value.status.placed_by == "placer-b"
        )

    await eventually(placed_by_b, timeout=15)


async def test_leases_without_a_persisted_epoch_are_released(
    bus: Bus, start_placer: StartPlacer
) -> None:
    await register(bus, [node_record(machine(f"m{i}", address=f"10.0.0.{i}")) for i in (1, 2)])
    leases = bus.bucket(names.BUCKET_LEASES, Lease)
    # A placer died between taking the leases and persisting the epoch.
    old = now() - timedelta(minutes=5)
    for node in ("m1", "m2"):
        await leases.put(node, Lease(gang="acme.ghost", epoch=1, placer="dead", created_time=old))
    placer = await start_placer()
    await Client(bus).apply(job("blocked"))
    jobs = bus.bucket(names.BUCKET_JOBS, Job)

    async def unschedulable() -> bool:
        current = await jobs.get("acme.blocked")
        ready = current.value.condition(ConditionType.GANG_READY) if current else None
        return ready is not None and ready.reason == "Unschedulable"

    await eventually(unschedulable)
    # A fresh lease (a commit in progress elsewhere) is left alone; orphans are freed.
    await leases.put("m3", Lease(gang="acme.busy", epoch=1, placer="alive", created_time=now()))
    assert await placer.release_stale_leases() == 2
    assert await leases.get("m3") is not None

    async def placed() -> bool:
        current = await jobs.get("acme.blocked")
        return current is not None and current.value.status.phase is Phase.PLACED

    await eventually(placed)
    # Reads of the whole buckets that come back short (a server failing over) free nothing
    # that a placed gang holds: each lease is freed on its epoch's and job's own word.

    async def nothing_read(keys: str = ">") -> dict[str, Any]:
        return {}

    with pytest.MonkeyPatch.context() as short_reads:
        short_reads.setattr(placer.members.epochs, "snapshot", nothing_read)
        short_reads.setattr(placer.members.jobs, "snapshot", nothing_read)
        assert await placer.release_stale_leases(grace_seconds=0) == 1  # m3's, of no epoch
    assert await leases.get("m1") is not None and await leases.get("m2") is not None

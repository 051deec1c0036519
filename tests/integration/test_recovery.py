"""A placer that dies, or whose bus fails mid-commit, leaves nothing stuck: another replica
takes over its Pending jobs; leases a crashed commit left without a persisted epoch are
released; an epoch persisted that its job never came to name is torn down, and an address
claim of no epoch freed, so that the job is placed again."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest

from libs.bus import Bus
from libs.client.client import Client
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.epochs import AddressClaim, Epoch, Lease
from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.jobs import ConditionType, Job, JobStatus, Phase
from services.placer.orphans import Released
from tests.conftest import StartPlacer, eventually, placed, until_gang_ready_says
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

    await until_gang_ready_says(bus, "acme.blocked", "Unschedulable")
    # A fresh lease (a commit in progress elsewhere) is left alone; orphans are freed.
    await leases.put("m3", Lease(gang="acme.busy", epoch=1, placer="alive", created_time=now()))
    assert (await placer.release_orphans()).leases == 2
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
        short_reads.setattr(placer.orphans.epochs, "snapshot", nothing_read)
        short_reads.setattr(placer.orphans.jobs, "snapshot", nothing_read)
        assert (await placer.release_orphans(grace_seconds=0)).leases == 1  # m3's, no epoch
    assert await leases.get("m1") is not None and await leases.get("m2") is not None


L4 = {"count": 1, "backend": "cuda", "model": "L4"}
CONTAINERS = [
    machine("c-1", provider="vast", offering="container", address="10.9.0.5", accelerators=L4),
    machine("c-2", provider="runpod", offering="container", address="10.9.0.6", accelerators=L4),
]
RELAYED = {"accelerators": {"model": "L4"}, "distributed": {"members": 2, "transport": "Auto"}}


async def test_an_epoch_its_job_never_named_is_torn_down_and_the_job_placed_again(
    bus: Bus, start_placer: StartPlacer
) -> None:
    await register(bus, [node_record(m) for m in CONTAINERS])
    placer = await start_placer()
    failed = asyncio.Event()
    mark_placed = placer.committer._mark_placed

    async def bus_fails_once(placements: Any) -> None:
        if not failed.is_set():
            failed.set()  # the epoch, its leases and address claims are written by now
            raise NodusError(ErrorCode.TIMEOUT, "the bus went away mid-commit")
        await mark_placed(placements)

    placer.committer._mark_placed = bus_fails_once  # type: ignore[method-assign]
    await Client(bus).apply(job("cut", org="acme", **RELAYED))
    await asyncio.wait_for(failed.wait(), 10)
    epochs = bus.bucket(names.BUCKET_EPOCHS, Epoch)
    first = await epochs.get(names.epoch_key("acme.cut", 1))
    assert first is not None and not first.value.fenced
    # Until the sweep, the job cannot be placed: the orphan's leases hold both machines (and
    # after those, its claims and its epoch number would refuse the job).
    jobs = bus.bucket(names.BUCKET_JOBS, Job)
    assert await placer.release_orphans() == Released()  # nothing old enough yet
    placer.committer._mark_placed = mark_placed  # type: ignore[method-assign]
    placer._capacity_changed()
    await until_gang_ready_says(bus, "acme.cut", "Unschedulable")
    current = await jobs.get("acme.cut")
    assert current is not None and current.value.status.phase is Phase.PENDING
    released = await placer.release_orphans(grace_seconds=0)
    assert released.epochs == 1
    gang = await placed(bus, "acme.cut")
    assert gang.status.epoch == 2
    first = await epochs.get(names.epoch_key("acme.cut", 1))
    assert first is not None and first.value.fenced
    claims = await bus.bucket(names.BUCKET_ADDRESSES, AddressClaim).snapshot()
    assert {(c.value.gang, c.value.epoch) for c in claims.values()} == {("acme.cut", 2)}
    # The live epoch, its leases and claims are left alone by the next sweep.
    assert await placer.release_orphans(grace_seconds=0) == Released()


async def test_an_address_claim_of_no_epoch_is_freed(bus: Bus, start_placer: StartPlacer) -> None:
    await register(bus, [node_record(m) for m in CONTAINERS])
    claims = bus.bucket(names.BUCKET_ADDRESSES, AddressClaim)
    # A commit whose release failed with the bus: its claim names an epoch never persisted.
    old = now() - timedelta(minutes=5)
    await claims.put(
        names.address_key("10.9.0.5"),
        AddressClaim(gang="acme.again", epoch=1, node="c-1", created_time=old),
    )
    await claims.put(  # a claim of a commit in progress elsewhere: left alone
        names.address_key("10.9.9.9"),
        AddressClaim(gang="acme.busy", epoch=1, node="c-9", created_time=now()),
    )
    placer = await start_placer()
    jobs = bus.bucket(names.BUCKET_JOBS, Job)
    said: list[str] = []

    async def record() -> None:
        async for change in jobs.watch("acme.again"):
            ready = change.value.condition(ConditionType.GANG_READY) if change.value else None
            if ready is not None and ready.reason == "IPCollision":
                said.append(ready.message)

    watcher = asyncio.create_task(record())
    try:
        await Client(bus).apply(job("again", org="acme", **RELAYED))

        async def colliding() -> bool:
            return any("still claimed by this gang's epoch 1" in message for message in said)

        await eventually(colliding)
    finally:
        watcher.cancel()
    assert (await placer.release_orphans()).addresses == 1
    gang = await placed(bus, "acme.again")
    assert gang.status.gang is not None
    assert await claims.get(names.address_key("10.9.9.9")) is not None

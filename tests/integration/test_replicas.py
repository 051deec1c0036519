"""Two placer replicas side by side: 50 jobs submitted at once are each placed exactly once and
no machine ends up in two gangs (compare-and-set leases and epochs)."""

from __future__ import annotations

import asyncio
from collections import Counter

import msgspec

from libs.bus import Bus
from libs.bus.server import NatsServer
from libs.client.client import Client
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.bounds import derive
from libs.contracts.epochs import Epoch, Lease
from libs.contracts.jobs import Job, PathClass, Phase
from tests.conftest import StartPlacer, eventually
from tests.factories import job, machine, node_record, register


async def test_two_placers_and_fifty_jobs_place_each_job_once(
    bus: Bus, nats_server: NatsServer, start_placer: StartPlacer
) -> None:
    # 120 machines in 3 regions; 50 jobs of 2 members need 100 of them.
    fleet = [
        machine(
            f"m{i:03d}",
            provider=["aws", "gcp", "lambda"][i % 3],
            region=["r1", "r2", "r3"][i % 3],
            address=f"10.{i // 250}.{i % 250}.1",
        )
        for i in range(120)
    ]
    await register(bus, [node_record(m) for m in fleet])
    placers = [await start_placer(replica="placer-a"), await start_placer(replica="placer-b")]
    assert len(placers) == 2
    clients = [Client(bus), await Client.connect(nats_server.url)]
    try:
        jobs = [
            job(f"j{i:02d}", distributed={"members": 2, "network": "Colocated"}) for i in range(50)
        ]
        replies = await asyncio.gather(*(clients[i % 2].apply(j) for i, j in enumerate(jobs)))
        assert all(reply.created for reply in replies)
        bucket = bus.bucket(names.BUCKET_JOBS, Job)

        async def all_placed() -> bool:
            records = await bucket.snapshot()
            return len(records) == 50 and all(
                r.value.status.phase is Phase.PLACED for r in records.values()
            )

        await eventually(all_placed, timeout=30)
        records = {k: v.value for k, v in (await bucket.snapshot()).items()}
        # Each job placed once: epoch 1, one epoch record per job.
        assert {j.status.epoch for j in records.values()} == {1}
        epochs = await bus.bucket(names.BUCKET_EPOCHS, Epoch).snapshot()
        assert sorted(epochs) == sorted(f"{key}.1" for key in records)
        # No machine in two gangs: across job statuses and across leases.
        members = Counter(
            m.node for j in records.values() if j.status.gang for m in j.status.gang.members
        )
        assert len(members) == 100 and set(members.values()) == {1}
        leases = await bus.bucket(names.BUCKET_LEASES, Lease).snapshot()
        assert {node: lease.value.gang for node, lease in leases.items()} == {
            m.node: key
            for key, j in records.items()
            if j.status.gang
            for m in j.status.gang.members
        }
        # Both replicas did real work.
        placed_by = Counter(j.status.placed_by for j in records.values())
        assert set(placed_by) == {"placer-a", "placer-b"}, placed_by
    finally:
        await clients[1].close()


async def test_an_epoch_torn_down_before_its_job_said_placed_is_never_reused(
    bus: Bus, start_placer: StartPlacer
) -> None:
    """A replica persisted epoch 1 and lost the job record's compare-and-set to another
    replica, so it fenced epoch 1 while the job still says epoch 0 (found by the chaos run):
    the job is placed as epoch 2, not left Pending retrying epoch 1 forever."""
    fleet = [machine(f"m{i}", address=f"10.0.0.{i + 1}") for i in range(2)]
    await register(bus, [node_record(m) for m in fleet])
    torn = Epoch(
        gang="acme.torn",
        epoch=1,
        path=PathClass.PRIVATE,
        mesh_id="m",
        verify_key="",
        members=[],
        bounds=derive(PathClass.PRIVATE, 2),
        created_time=now(),
        join_keys_expire_time=now(),
        placed_by="placer-x",
        fenced=True,
    )
    await bus.bucket(names.BUCKET_EPOCHS, Epoch).put("acme.torn.1", torn)
    await start_placer()
    client = Client(bus)
    await client.apply(job("torn", distributed={"members": 2, "network": "Colocated"}))

    async def placed() -> bool:
        found = await client.get_job("torn")
        return found.status.phase is Phase.PLACED

    await eventually(placed)
    found = await client.get_job("torn")
    assert found.status.epoch == 2
    first = await bus.bucket(names.BUCKET_EPOCHS, Epoch).get("acme.torn.1")
    assert first is not None and first.value.fenced  # fenced stays fenced


async def test_a_replica_killed_mid_placement_places_its_pending_job_when_it_is_back(
    bus: Bus, start_placer: StartPlacer
) -> None:
    """A replica admitted a job and died before it said Placed; it comes back under its name
    (a systemd restart): the job, Pending with placedBy its name and no epoch yet, is placed
    (found by the chaos run: such a job stayed Pending for ever)."""
    fleet = [machine(f"k{i}", address=f"10.0.1.{i + 1}") for i in range(2)]
    await register(bus, [node_record(m) for m in fleet])
    spec = job("orphan", distributed={"members": 2, "network": "Colocated"})
    left = msgspec.structs.replace(
        spec, status=msgspec.structs.replace(spec.status, placed_by="placer-k", created_time=now())
    )
    await bus.bucket(names.BUCKET_JOBS, Job).put(left.key, left)
    await start_placer(replica="placer-k")
    client = Client(bus)

    async def placed() -> bool:
        return (await client.get_job("orphan")).status.phase is Phase.PLACED

    await eventually(placed)

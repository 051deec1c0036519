"""Placement in batches (issue 25) decides what placing one job at a time decided: the same
machines and path for every job of a seeded workload, applied in order; and a lease, an epoch
or a job record lost to another writer mid-batch costs that job a new plan, not the batch."""

from __future__ import annotations

import asyncio
import random

import msgspec

from libs.bus import Bus
from libs.client.client import Client
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.epochs import Lease
from libs.contracts.errors import NodusError
from libs.contracts.jobs import ConditionType, Job, Phase
from libs.contracts.placer import PlacerConfig
from services.placer import admission
from services.placer.candidates import Candidates
from services.placer.commit import CONFLICTS
from services.placer.planner import Exclusions, Planner
from tests.bench.placement_workload import build_fleet, build_jobs
from tests.conftest import StartPlacer, eventually
from tests.factories import job as make_job
from tests.factories import machine, node_record, register

Decision = tuple[str, tuple[str, ...]]  # path (or refused / unschedulable), members' nodes


def one_at_a_time(
    config: PlacerConfig, free: Candidates, registered: Candidates, jobs: list[Job]
) -> dict[str, Decision]:
    """What the placer decided before batches: each job in the order it was applied, admitted
    against the registered fleet, planned against the free machines its predecessors left."""
    planner = Planner(config)
    decisions: dict[str, Decision] = {}
    for job in jobs:
        try:
            admission.check_feasible(job, planner, registered)
        except NodusError:
            decisions[job.key] = ("refused", ())
            continue
        plan, _ = planner.plan(job, free, Exclusions())
        if plan is None:
            decisions[job.key] = ("unschedulable", ())
            continue
        for node in plan.nodes:
            free.remove(node)
        decisions[job.key] = (plan.path.value, tuple(plan.nodes))
    return decisions


async def test_a_seeded_burst_is_placed_as_one_job_at_a_time_placed_it(
    bus: Bus, start_placer: StartPlacer, placer_config: PlacerConfig
) -> None:
    rng = random.Random(25)
    fleet = build_fleet(400, rng)
    jobs = build_jobs(120, rng, prefix="seeded")
    for record in fleet:  # one at a time: the placer's view holds them in this order
        await register(bus, [record])
    config = msgspec.structs.replace(placer_config, distributed_access=["*"])
    placer = await start_placer(config=config, replica="placer-seeded")
    # The view's own order of machines (the order the watches made them free), copied before
    # the first job: the one-at-a-time placer planned against exactly this.
    in_view_order = [placer.view.records[node] for node in placer.view.free._where]
    assert len(in_view_order) == len(fleet)
    # The order the placer queued the jobs in (the one-at-a-time placer planned in that
    # order), and the size of each batch it placed.
    queued: list[str] = []
    batches: list[int] = []
    mark, work = placer.queue.mark, placer.queue._work

    def mark_in_order(key: str) -> None:
        if key not in queued:
            queued.append(key)
        mark(key)

    async def work_in_batches(keys: list[str]) -> None:
        batches.append(len(keys))
        await work(keys)

    placer.queue.mark = mark_in_order  # type: ignore[method-assign]
    placer.queue._work = work_in_batches

    client = Client(bus)
    decided: dict[str, Decision] = {}

    async def apply(job: Job) -> None:
        try:
            await client.apply(job)
        except NodusError:
            decided[job.key] = ("refused", ())

    await asyncio.gather(*(apply(job) for job in jobs))  # at once: they wait in batches
    store = bus.bucket(names.BUCKET_JOBS, Job)

    async def all_decided() -> bool:
        for key, found in (await store.snapshot()).items():
            status = found.value.status
            if status.phase is Phase.PLACED and status.gang is not None:
                members = tuple(m.node for m in status.gang.members)
                decided[key] = (status.gang.transport.value, members)
            ready = found.value.condition(ConditionType.GANG_READY)
            if status.phase is Phase.PENDING and ready and ready.reason == "Unschedulable":
                decided[key] = ("unschedulable", ())
        return len(decided) == len(jobs)

    await eventually(all_decided, timeout=60)
    by_key = {job.key: job for job in jobs}
    in_queue_order = [by_key[key] for key in queued] + [
        job
        for job in jobs
        if job.key not in queued  # refused: never queued
    ]
    registered = placer.view.registered
    expected = one_at_a_time(config, Candidates(in_view_order), registered, in_queue_order)
    assert decided == expected
    assert max(batches) > 1  # several jobs planned against one view and committed together
    outcomes = {path for path, _ in expected.values()}
    assert {"private", "direct", "relayed"} <= outcomes  # the workload reaches every path


async def test_a_lease_lost_mid_commit_places_that_job_again_elsewhere(
    bus: Bus, start_placer: StartPlacer
) -> None:
    """Another replica holds a machine this replica's view still thinks free: the job planned
    on it loses the lease's compare-and-set, gives back what it took and is planned again;
    every job ends on machines of its own (R14)."""
    fleet = [machine(f"m{i}", address=f"10.0.7.{i + 1}") for i in range(7)]
    await register(bus, [node_record(m) for m in fleet])
    placer = await start_placer(replica="placer-batch")
    placer._tasks[2].cancel()  # its lease watch: the lease below never reaches its view
    leases = bus.bucket(names.BUCKET_LEASES, Lease)
    taken = Lease(gang="other.gang", epoch=1, placer="placer-other", created_time=now())
    assert await leases.create("m0", taken) is not None
    lost_before = CONFLICTS.labels("lease")._value.get()
    client = Client(bus)
    names_ = ("first", "second", "third")
    for name in names_:  # six machines are truly free: three gangs fit only without m0
        await client.apply(make_job(name, distributed={"members": 2, "network": "Colocated"}))

    async def placed() -> bool:
        found = [await client.get_job(name) for name in names_]
        return all(job.status.phase is Phase.PLACED for job in found)

    await eventually(placed, timeout=20)
    gangs = [(await client.get_job(name)).status.gang for name in names_]
    members = [{m.node for m in gang.members} for gang in gangs if gang is not None]
    assert len(members) == 3 and all("m0" not in gang for gang in members)
    assert len(set().union(*members)) == 6  # no machine in two gangs
    assert CONFLICTS.labels("lease")._value.get() > lost_before  # the race did happen
    stored = await leases.get("m0")
    assert stored is not None and stored.value.gang == "other.gang"

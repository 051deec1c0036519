"""The placer's asyncio shell: the cluster view from KV watches, the apply and delete API,
and the placement loop that commits plans with compare-and-set writes (R14-style replicas)."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from datetime import datetime
from typing import Literal

import msgspec
from nats.errors import Error as NatsError
from prometheus_client import Counter, Gauge, Histogram

from libs.bus import Bus, Endpoint, Versioned, check_plan_generations
from libs.contracts import names
from libs.contracts.api import ApplyReply, ApplyRequest, DeleteReply, DeleteRequest
from libs.contracts.base import now
from libs.contracts.bounds import RELATIVE_TO_DIRECT, derive
from libs.contracts.epochs import (
    AddressClaim,
    Epoch,
    EpochMember,
    JoinKeyGrant,
    Lease,
    Ranktable,
    RanktableEntry,
)
from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.fleet import NodeHealth, NodeRecord
from libs.contracts.jobs import (
    FINISHED_PHASES,
    Estimate,
    GangMember,
    GangStatus,
    Job,
    JobEvent,
    JobStatus,
    PathClass,
    Phase,
)
from libs.contracts.placer import PlacerConfig
from libs.contracts.qualify import Qualification
from libs.jobs import lifecycle
from libs.jobs.store import advance
from libs.mesh import MeshIdentity
from libs.runtime.tasks import TaskSet, cancel_and_wait
from libs.runtime.version import VERSION
from services.placer import admission
from services.placer.cluster import ClusterView, follow_cordons
from services.placer.environment import device_names, rank_environments
from services.placer.planner import Exclusions, Plan, Planner, Shortfall, check_plan

log = logging.getLogger("nodus.placer")

DECISIONS = Counter("nodus_placer_decisions_total", "Placement outcomes", ["outcome"])
ADMISSIONS = Counter("nodus_placer_admissions_total", "Apply requests by outcome", ["outcome"])
CONFLICTS = Counter("nodus_placer_conflicts_total", "Compare-and-set races lost", ["what"])
PLACE_SECONDS = Histogram(
    "nodus_placer_place_seconds",
    "Time to commit one placement",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
FREE_NODES = Gauge("nodus_placer_free_nodes", "Live, healthy machines no gang holds")
WAITING_JOBS = Gauge("nodus_placer_waiting_jobs", "Admitted jobs waiting for capacity")

STALE_SWEEP_TICKS = 15  # seconds between stale-lease sweeps
STALE_LEASE_SECONDS = 30.0  # a commit never takes this long; older orphans are freed

RELAYED_WARNING = (
    "Relayed is assumed 4x slower than Direct until its qualification benchmark publishes "
    "measured numbers; it suits small models and jobs that communicate little"
)


class _Retry(Exception):
    """A race lost mid-commit: plan again with a fresher view."""


class Placer:
    def __init__(self, bus: Bus, config: PlacerConfig, replica: str | None = None) -> None:
        self.bus = bus
        self.config = config
        self.planner = Planner(config)
        self.replica = replica or f"placer-{secrets.token_hex(3)}"
        self.view = ClusterView(config.heartbeat_timeout_seconds)
        self.jobs = bus.bucket(names.BUCKET_JOBS, Job)
        self.nodes = bus.bucket(names.BUCKET_NODES, NodeRecord)
        self.health = bus.bucket(names.BUCKET_HEALTH, NodeHealth)
        self.leases = bus.bucket(names.BUCKET_LEASES, Lease)
        self.addresses = bus.bucket(names.BUCKET_ADDRESSES, AddressClaim)
        self.epochs = bus.bucket(names.BUCKET_EPOCHS, Epoch)
        self.joinkeys = bus.bucket(names.BUCKET_JOINKEYS, JoinKeyGrant)
        self.ranktables = bus.bucket(names.BUCKET_RANKTABLES, Ranktable)
        self.qualifications = bus.bucket(names.BUCKET_QUALIFICATIONS, Qualification)
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._queued: set[str] = set()
        self._waiting: set[str] = set()  # admitted, no capacity yet
        self._tasks: list[asyncio.Task[None]] = []
        self._in_flight: set[str] = set()  # jobs being placed right now
        self._rerun: set[str] = set()  # asked for again while in flight
        self._placing = TaskSet("placing", log)
        self._background = TaskSet("placer background", log)
        self._slots = asyncio.Semaphore(config.placement_concurrency)
        self._active: dict[str, tuple[int, list[str]]] = {}  # placed gangs: epoch, members
        self._boots: dict[str, tuple[int, dict[str, str]]] = {}  # see _placed_boots
        self._feasible_cache: dict[bytes, NodusError | None] = {}
        self._feasible_version = -1

    # -- start and stop ------------------------------------------------------------------------

    async def start(self) -> None:
        # One pass per bucket: each watch delivers the current values, then every change.
        caught_up = [asyncio.Event() for _ in range(3)]
        self._tasks = [
            asyncio.create_task(self._watch_nodes(caught_up[0])),
            asyncio.create_task(self._watch_health(caught_up[1])),
            asyncio.create_task(self._watch_leases(caught_up[2])),
        ]
        await asyncio.gather(*(event.wait() for event in caught_up))
        self._tasks += [
            asyncio.create_task(self._watch_jobs()),
            asyncio.create_task(self._watch_qualifications()),
            asyncio.create_task(self._worker()),
            asyncio.create_task(self._sweeper()),
            asyncio.create_task(follow_cordons(self.bus, self.view, self._capacity_changed)),
        ]
        await self.bus.serve(
            "nodus-placer",
            VERSION,
            "Admits and places distributed jobs",
            [
                Endpoint("apply", names.API_JOBS_APPLY, ApplyRequest, self.apply, concurrency=64),
                Endpoint("delete", names.API_JOBS_DELETE, DeleteRequest, self.delete),
            ],
            queue_group="nodus-placer",
        )
        log.info("placer %s ready with %d machines", self.replica, len(self.view.records))

    async def stop(self) -> None:
        await cancel_and_wait([*self._tasks, *self._placing, *self._background])

    # -- the API -------------------------------------------------------------------------------

    async def apply(self, request: ApplyRequest) -> ApplyReply:
        submitted = request.job
        try:
            admission.check_static(submitted, self.planner)
            self._check_feasible(submitted)
        except NodusError:
            ADMISSIONS.labels("refused").inc()
            raise
        spec_only = Job(metadata=submitted.metadata, spec=submitted.spec)
        existing = await self.jobs.get(spec_only.key)
        if existing is not None:
            if msgspec.json.encode(existing.value.spec) != msgspec.json.encode(spec_only.spec):
                raise NodusError(
                    ErrorCode.IMMUTABLE,
                    f"job {spec_only.key} exists with another spec; a gang's spec cannot change "
                    "while it lives: delete it first",
                )
            ADMISSIONS.labels("unchanged").inc()
            return ApplyReply(job=existing.value, created=False)
        step = lifecycle.admitted(now(), self.replica)
        job = msgspec.structs.replace(spec_only, status=step.status)
        if await self.jobs.create(job.key, job) is None:
            raise NodusError(ErrorCode.ALREADY_EXISTS, f"job {job.key} was created concurrently")
        ADMISSIONS.labels("admitted").inc()
        self._step_event(job, step)
        self._enqueue(job.key)
        return ApplyReply(job=job, created=True)

    def _check_feasible(self, job: Job) -> None:
        """Could the job run on the registered fleet if it were idle? Cached per spec shape."""
        if self._feasible_version != self.view.inventory_version:
            self._feasible_cache.clear()
            self._feasible_version = self.view.inventory_version
        shape = msgspec.json.encode((job.spec.accelerators, job.spec.distributed, job.metadata.org))
        if shape not in self._feasible_cache:
            try:
                admission.check_feasible(job, self.planner, self.view.registered)
                self._feasible_cache[shape] = None
            except NodusError as error:
                self._feasible_cache[shape] = error
        refusal = self._feasible_cache[shape]
        if refusal is not None:
            raise refusal

    async def delete(self, request: DeleteRequest) -> DeleteReply:
        key = f"{request.org}.{request.name}"
        for _ in range(self.config.max_attempts):
            current = await self.jobs.get(key)
            if current is None:
                raise NodusError(
                    ErrorCode.NOT_FOUND, f"job {request.name} (org {request.org}) does not exist"
                )
            job = current.value
            # Fence the epoch first (G9), then free what it held, then forget the job, unless
            # a placement landed meanwhile: then its new epoch is torn down on the next pass.
            if job.status.epoch:
                await self._teardown(job.key, job.status.epoch)
            if await self.jobs.delete(key, current.revision):
                self._waiting.discard(key)
                self._event(job, "deleted", job.status.epoch, "deleted by request")
                return DeleteReply(deleted=True)
        raise NodusError(ErrorCode.CONFLICT, f"job {key} kept changing while being deleted; retry")

    # -- watches -------------------------------------------------------------------------------

    async def _watch_nodes(self, caught_up: asyncio.Event) -> None:
        async for change in self.nodes.watch(caught_up=caught_up):
            self.view.set_record(change.key, change.value, now())
            self._capacity_changed()

    async def _watch_health(self, caught_up: asyncio.Event) -> None:
        async for change in self.health.watch(caught_up=caught_up):
            was = change.key in self.view.free
            self.view.set_health(change.key, change.value, now())
            if (change.key in self.view.free) != was:
                self._capacity_changed()

    async def _watch_leases(self, caught_up: asyncio.Event) -> None:
        async for change in self.leases.watch(caught_up=caught_up):
            self.view.set_lease(change.key, change.value, now())
            if change.value is None:
                self._capacity_changed()

    async def _watch_qualifications(self) -> None:
        """G21: the pairs `nodus qualify` measured are qualified for their path from now on;
        one that failed its run is not (and a later failure takes the pair back)."""
        measured: dict[str, Qualification] = {}
        async for change in self.qualifications.watch():
            if change.value is None:
                measured.pop(change.key, None)
            else:
                measured[change.key] = change.value
            self.planner.measured = {}
            for record in measured.values():
                if record.ok:
                    self.planner.measured.setdefault(record.path, set()).add(record.pair)
            self._feasible_cache.clear()
            self._capacity_changed()

    async def _watch_jobs(self) -> None:
        """Another replica's Pending job is taken over once it has waited `takeover_seconds`."""
        async for change in self.jobs.watch():
            job = change.value
            if job is not None and job.status.phase in lifecycle.ACTIVE and job.status.gang:
                self._active[change.key] = (
                    job.status.epoch,
                    [m.node for m in job.status.gang.members],
                )
            else:
                self._active.pop(change.key, None)
            if job is not None and job.status.phase in FINISHED_PHASES and job.status.epoch:
                self._finished(job)
            if job is None or job.status.phase is not Phase.PENDING:
                continue
            if job.status.placed_by == self.replica:
                if change.key not in self._in_flight:
                    # Sent back for a new epoch (probe failed, member lost), or left Pending
                    # by this replica's previous life, killed mid-placement (chaos seed
                    # 276742): nobody else will place it.
                    self._enqueue(change.key)
                continue
            asyncio.get_running_loop().call_later(
                self.config.takeover_seconds, self._enqueue, change.key
            )

    async def _sweeper(self) -> None:
        ticks = 0
        while True:
            await asyncio.sleep(1.0)
            ticks += 1
            if self.view.sweep(now()):
                self._capacity_changed()
            await self._check_members()
            FREE_NODES.set(len(self.view.free))
            WAITING_JOBS.set(len(self._waiting))
            if ticks % STALE_SWEEP_TICKS == 0:
                try:
                    await self.release_stale_leases()
                except Exception as error:  # the next sweep tries again
                    log.warning("stale lease sweep failed: %s", error)

    def _finished(self, job: Job) -> None:
        """A gang that ended gives its machines back: its epoch is fenced and torn down (the
        job record, its status and the ranks' logs stay)."""

        async def release() -> None:
            stored = await self.epochs.get(names.epoch_key(job.key, job.status.epoch))
            if stored is not None and not stored.value.fenced:
                await self._teardown(job.key, job.status.epoch)

        self._background.spawn(release(), name=f"release {job.key}")

    async def _placed_boots(self, key: str, epoch: int) -> dict[str, str]:
        """The boot of each member's machine when `epoch` was placed, read once per epoch."""
        cached = self._boots.get(key)
        if cached is not None and cached[0] == epoch:
            return cached[1]
        stored = await self.epochs.get(names.epoch_key(key, epoch))
        boots = {m.node: m.boot_id for m in stored.value.members} if stored else {}
        self._boots[key] = (epoch, boots)
        return boots

    def _booted_since(self, node: str, placed_boot: str) -> bool:
        health = self.view.health.get(node)
        return bool(placed_boot and health and health.boot_id and health.boot_id != placed_boot)

    async def _check_members(self) -> None:
        """A member that stops heartbeating, is marked unhealthy, or whose machine booted again
        since placement (its agent restarted: ranks and tunnels gone) ends its gang's epoch:
        the gang goes back to placement without it, and its next epoch fences this one first."""
        t = now()
        for key in set(self._boots) - set(self._active):
            del self._boots[key]
        for key, (epoch, members) in list(self._active.items()):
            lost = [node for node in members if not self.view.alive(node, t)]
            try:
                boots = await self._placed_boots(key, epoch)
            except (NodusError, NatsError, OSError, TimeoutError) as error:
                log.warning("%s: epoch %d's members not read: %s", key, epoch, error)
                boots = {}
            booted = [
                node
                for node in members
                if node not in lost and self._booted_since(node, boots.get(node, ""))
            ]
            if not lost and not booted:
                continue
            reasons = []
            if lost:
                reasons.append(f"{', '.join(lost)} stopped heartbeating or turned unhealthy")
            if booted:
                reasons.append(f"{', '.join(booted)} booted again (its ranks and tunnels are gone)")
            lost += booted
            message = f"{'; '.join(reasons)}; epoch {epoch} ends"

            def replace(
                status: JobStatus, lost: list[str] = lost, message: str = message
            ) -> lifecycle.Step:
                return lifecycle.members_lost(status, lost, lifecycle.MEMBER_LOST, message, t)

            self._active.pop(key, None)
            if await advance(self.bus, key, epoch, lifecycle.MEMBERS_LOST, replace):
                log.warning("%s: %s", key, message)

    async def release_stale_leases(self, grace_seconds: float = STALE_LEASE_SECONDS) -> int:
        """Reconcile leases with epochs and jobs: a lease whose epoch was never persisted (a
        placer died mid-commit), is fenced, or is not its job's current epoch frees its machine
        once it is older than the grace period (a commit in flight is younger)."""
        t = now()
        epochs = await self.epochs.snapshot()
        jobs = await self.jobs.snapshot()
        released = 0
        for node, lease in (await self.leases.snapshot()).items():
            held = lease.value
            epoch = epochs.get(names.epoch_key(held.gang, held.epoch))
            job = jobs.get(held.gang)
            current = job is not None and job.value.status.epoch == held.epoch
            if epoch is not None and not epoch.value.fenced and current:
                continue
            age = (t - held.created_time).total_seconds() if held.created_time else grace_seconds
            if age < grace_seconds:
                continue
            if await self.leases.delete(node, lease.revision):
                released += 1
                log.info("released stale lease on %s (%s epoch %d)", node, held.gang, held.epoch)
        return released

    def _capacity_changed(self) -> None:
        for key in list(self._waiting):
            self._enqueue(key)

    def _enqueue(self, key: str) -> None:
        if key not in self._queued:
            self._queued.add(key)
            self._queue.put_nowait(key)

    # -- placement -----------------------------------------------------------------------------

    async def _worker(self) -> None:
        """Place queued jobs, several at once: planning is synchronous and reserves its machines
        in the view before the first await, so concurrent commits never pick the same ones."""
        while True:
            key = await self._queue.get()
            self._queued.discard(key)
            if key in self._in_flight:
                self._rerun.add(key)
                continue
            await self._slots.acquire()
            self._in_flight.add(key)
            self._placing.spawn(self._place_one(key), name=f"place {key}")

    async def _place_one(self, key: str) -> None:
        started = time.perf_counter()
        try:
            await self._place(key)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("placing %s failed; will retry on the next capacity change", key)
            self._waiting.add(key)
        finally:
            self._in_flight.discard(key)
            self._slots.release()
            PLACE_SECONDS.observe(time.perf_counter() - started)
            if key in self._rerun:
                self._rerun.discard(key)
                self._enqueue(key)

    async def _place(self, key: str) -> None:
        exclusions = Exclusions()
        for _attempt in range(self.config.max_attempts):
            current = await self.jobs.get(key)
            if current is None or current.value.status.phase is not Phase.PENDING:
                self._waiting.discard(key)
                return
            old_epoch = current.value.status.epoch
            if old_epoch:
                # A restart fences the old epoch first (G9): its members reach nobody any more,
                # its machines are free again; then the next epoch is placed.
                await self._teardown(key, old_epoch)
            # Before planning: between a plan and its leases nothing may wait (the view
            # reserves the machines, so this replica's other placements skip them).
            epoch = await self._next_epoch(current.value)
            mesh = MeshIdentity()
            plan, shortfalls = self._plan_avoiding(current.value, exclusions, mesh.mesh_id)
            if plan is None:
                self._waiting.add(key)
                DECISIONS.labels("unschedulable").inc()
                message = "; ".join(s.message for s in shortfalls)
                await self._set_gang_ready(current, "False", "Unschedulable", message)
                return
            try:
                await self._commit(current, plan, mesh, exclusions, epoch)
                self._waiting.discard(key)
                DECISIONS.labels("placed").inc()
                return
            except _Retry:
                continue
        self._waiting.add(key)
        DECISIONS.labels("gave_up").inc()

    def _plan_avoiding(
        self, job: Job, exclusions: Exclusions, mesh_id: str
    ) -> tuple[Plan | None, list[Shortfall]]:
        """Plan without the machines the job lost or failed a probe on (`status.avoid`) while
        others can take their place; when none can, a member it lost that is healthy and free
        again (its repair done, its agent back) rather than waiting for ever. A probe's
        suspect is never used again (G12)."""
        avoided = set(job.status.avoid)
        lost = avoided & set(job.status.lost)
        avoiding = Exclusions(avoided, exclusions.addresses)
        plan, shortfalls = self.planner.plan(job, self.view.free, avoiding, mesh_id)
        if plan is None and lost:
            suspects = Exclusions(avoided - lost, exclusions.addresses)
            plan, _ = self.planner.plan(job, self.view.free, suspects, mesh_id)
            if plan is not None:
                again = sorted(lost & {m.node for m in plan.members})
                log.info("%s: placed on %s again: no other machine fits", job.key, again)
        return plan, shortfalls

    async def _commit(
        self,
        current: Versioned[Job],
        plan: Plan,
        mesh: MeshIdentity,
        exclusions: Exclusions,
        epoch: int,
    ) -> None:
        """Commit a plan in its order: the machines (and on Relayed the addresses), the epoch,
        the members' join keys, then the job says Placed. A race lost raises _Retry."""
        job = current.value
        records = {node: self.view.records[node] for node in plan.nodes}
        problems = check_plan(plan, records, job)
        if problems:  # the planner's own invariants: never commit a plan that breaks them
            raise NodusError(ErrorCode.INTERNAL, f"plan for {job.key} breaks {problems}")
        t = now()
        record = self._epoch_record(job, plan, records, epoch, mesh, t)
        lease = Lease(gang=job.key, epoch=epoch, placer=self.replica, created_time=t)
        await self._persist_epoch(current, plan, record, lease, exclusions)
        await self._grant_join_keys(record, mesh)
        await self._mark_placed(current, plan, record, lease)

    async def _next_epoch(self, job: Job) -> int:
        """The job's next epoch number: past any fenced one. A placement whose job record
        changed under it is torn down after its epoch was persisted, so that number is used,
        fenced, while the job still names the one before; epochs are never reused."""
        epoch = job.status.epoch + 1
        while True:
            found = await self.epochs.get(names.epoch_key(job.key, epoch))
            if found is None or not found.value.fenced:
                return epoch  # free, or another replica's live placement (create refuses)
            epoch += 1

    async def _persist_epoch(
        self, current: Versioned[Job], plan: Plan, record: Epoch, lease: Lease, ex: Exclusions
    ) -> None:
        """Take the machines and addresses, then persist the epoch record before anything that
        names it leaves (C2/G9); whatever fails on the way gives back what was taken."""
        held = await self._acquire_leases(plan.nodes, lease, record.created_time)
        claimed: list[tuple[str, int]] = []
        try:
            if plan.path is PathClass.RELAYED:
                await self._claim_addresses(current, plan, record.epoch, ex, claimed)
            if await self.epochs.create(names.epoch_key(record.gang, record.epoch), record) is None:
                CONFLICTS.labels("epoch").inc()
                raise _Retry
        except BaseException:
            await self._release(plan.nodes, held, claimed)
            raise

    async def _grant_join_keys(self, record: Epoch, mesh: MeshIdentity) -> None:
        gang, epoch, expires = record.gang, record.epoch, record.join_keys_expire_time
        await asyncio.gather(
            *(
                self.joinkeys.put(
                    names.joinkey_key(m.node, gang, epoch),
                    JoinKeyGrant(
                        token=mesh.mint(gang, epoch, m.node, expires),
                        verify_key=mesh.verify_key,
                        epoch=record,
                    ),
                )
                for m in record.members
            )
        )

    async def _mark_placed(
        self, current: Versioned[Job], plan: Plan, record: Epoch, lease: Lease
    ) -> None:
        """The job says Placed, unless it changed meanwhile: then the epoch is undone."""
        gang, epoch = record.gang, record.epoch
        step = lifecycle.placed(
            current.value.status, epoch, self._gang_status(plan), self.replica, record.created_time
        )
        status = step.status
        placed = msgspec.structs.replace(current.value, status=status)
        ranktable = self._ranktable(placed, record)
        # C2: every part of the plan names one generation, checked before the job says Placed.
        check_plan_generations(
            gang,
            [
                ("epoch", record.epoch),
                ("lease", lease.epoch),
                ("job", status.epoch),
                ("ranktable", ranktable.epoch),
            ],
        )
        if await self.jobs.update(gang, placed, current.revision) is None:
            # Deleted or changed under us: undo this epoch entirely.
            CONFLICTS.labels("job").inc()
            await self._teardown(gang, epoch)
            raise _Retry
        await self.ranktables.put(gang, ranktable)
        self._step_event(placed, step)

    async def _acquire_leases(self, nodes: list[str], lease: Lease, t: datetime) -> dict[str, int]:
        for node in nodes:  # reserved in the view before any await: our other commits skip them
            self.view.set_lease(node, lease, t)
        results = await asyncio.gather(*(self.leases.create(node, lease) for node in nodes))
        held = {node: rev for node, rev in zip(nodes, results, strict=True) if rev is not None}
        if len(held) != len(nodes):
            CONFLICTS.labels("lease").inc()
            lost = [node for node in nodes if node not in held]
            for node in held:  # roll back ours; the others stay marked until their watch says
                await self.leases.delete(node, held[node])
                self.view.set_lease(node, None, t)
            log.debug("lost leases on %s; planning again", lost)
            raise _Retry
        return held

    async def _claim_addresses(
        self,
        current: Versioned[Job],
        plan: Plan,
        epoch: int,
        exclusions: Exclusions,
        claimed: list[tuple[str, int]],
    ) -> None:
        """G7: no two running Relayed gangs route one address; a collision re-places."""
        gang = current.value.key
        for member in plan.members:
            key = names.address_key(member.address)
            claim = AddressClaim(gang=gang, epoch=epoch, node=member.node)
            revision = await self.addresses.create(key, claim)
            if revision is not None:
                claimed.append((key, revision))
                continue
            holder = await self.addresses.get(key)
            if holder is not None and holder.value.gang == gang and holder.value.epoch < epoch:
                # Our own older epoch's claim: take it over.
                revision = await self.addresses.update(key, claim, holder.revision)
                if revision is not None:
                    claimed.append((key, revision))
                    continue
            other = holder.value.gang if holder else "another gang"
            exclusions.addresses.add(member.address)
            CONFLICTS.labels("address").inc()
            await self._set_gang_ready(
                current,
                "False",
                "IPCollision",
                f"address {member.address} of {member.node} is routed by running Relayed gang "
                f"{other}; placing the members again",
            )
            raise _Retry

    async def _release(
        self, nodes: list[str], held: dict[str, int], claimed: list[tuple[str, int]]
    ) -> None:
        t = now()
        for key, revision in claimed:
            await self.addresses.delete(key, revision)
        for node in nodes:
            if node in held:
                await self.leases.delete(node, held[node])
                self.view.set_lease(node, None, t)

    async def _teardown(self, gang: str, epoch: int) -> None:
        """Fence an epoch (G9), then free its join keys, addresses and machines; idempotent."""
        key = names.epoch_key(gang, epoch)

        def fence(record: Epoch | None) -> Epoch | None:
            if record is None or record.fenced:
                return None
            return msgspec.structs.replace(record, fenced=True)

        await self.epochs.mutate(key, fence)
        record = await self.epochs.get(key)
        if record is None:
            return
        for member in record.value.members:
            await self.joinkeys.delete(names.joinkey_key(member.node, gang, epoch))
            if record.value.path is PathClass.RELAYED:
                address_key = names.address_key(member.address)
                claim = await self.addresses.get(address_key)
                if claim and claim.value.gang == gang and claim.value.epoch == epoch:
                    await self.addresses.delete(address_key, claim.revision)
            lease = await self.leases.get(member.node)
            if lease and lease.value.gang == gang and lease.value.epoch == epoch:
                await self.leases.delete(member.node, lease.revision)
        ranktable = await self.ranktables.get(gang)
        if ranktable and ranktable.value.epoch == epoch:
            await self.ranktables.delete(gang, ranktable.revision)

    # -- records -------------------------------------------------------------------------------

    def _gang_status(self, plan: Plan) -> GangStatus:
        factor = RELATIVE_TO_DIRECT[plan.path]
        return GangStatus(
            transport=plan.path,
            members=[GangMember(rank=m.rank, node=m.node, address=m.address) for m in plan.members],
            estimate=Estimate(
                relative_to_direct=factor,
                warning=RELAYED_WARNING if plan.path is PathClass.RELAYED else None,
            ),
        )

    def _epoch_record(
        self,
        job: Job,
        plan: Plan,
        records: dict[str, NodeRecord],
        epoch: int,
        mesh: MeshIdentity,
        t: datetime,
    ) -> Epoch:
        envs = rank_environments(
            job,
            plan,
            records,
            epoch,
            self.config.master_port,
            self.config.shim_path,
            self.config.checkpoint_root,
        )
        bounds = derive(plan.path, len(plan.members))
        return Epoch(
            gang=job.key,
            epoch=epoch,
            path=plan.path,
            mesh_id=mesh.mesh_id,
            verify_key=mesh.verify_key,
            members=[
                EpochMember(
                    rank=m.rank,
                    node=m.node,
                    address=m.address,
                    interface=m.interface,
                    devices=device_names(records[m.node]),
                    env=envs[m.rank],
                    boot_id=records[m.node].boot_id,
                )
                for m in plan.members
            ],
            bounds=bounds,
            created_time=t,
            join_keys_expire_time=MeshIdentity.expiry(t, bounds.join_key_ttl_seconds),
            placed_by=self.replica,
        )

    def _ranktable(self, job: Job, epoch: Epoch) -> Ranktable:
        return Ranktable(
            gang=job.key,
            epoch=epoch.epoch,
            path=epoch.path,
            phase=job.status.phase.value,
            entries=[
                RanktableEntry(
                    rank=m.rank,
                    node=m.node,
                    address=m.address,
                    eth0=self.view.records[m.node].inventory.address,
                    devices=m.devices,
                    status=job.status.phase.value,
                )
                for m in epoch.members
            ],
            updated_time=epoch.created_time,
        )

    async def _set_gang_ready(
        self,
        current: Versioned[Job],
        state: Literal["True", "False", "Unknown"],
        reason: str,
        message: str,
    ) -> None:
        """Record why the gang is not ready; skipped when it already says so."""
        step = lifecycle.not_ready(current.value.status, state, reason, message, now())
        if step.event is None:
            return
        job = msgspec.structs.replace(current.value, status=step.status)
        await self.jobs.update(current.key, job, current.revision)
        self._step_event(job, step)

    def _step_event(self, job: Job, step: lifecycle.Step) -> None:
        if step.event is not None:
            self._event(job, step.event, job.status.epoch, step.message)

    def _event(self, job: Job, kind: str, epoch: int, message: str) -> None:
        """Publish a job event in the background: the KV record is the truth, and nobody waits
        on the event's acknowledgement (a lost event is logged)."""
        event = JobEvent(gang=job.key, kind=kind, epoch=epoch, message=message, time=now())

        async def publish() -> None:
            try:
                await self.bus.publish(names.job_event(job.key, kind.lower()), event)
            except Exception as error:
                log.warning("event %s for %s not published: %s", kind, job.key, error)

        self._background.spawn(publish(), name=f"event {kind} {job.key}")

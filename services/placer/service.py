"""The placer's asyncio shell: the cluster view from KV watches, the apply and delete API,
and the placement loop: a job queued is planned against the view and committed (`commit`,
compare-and-set writes, R14-style replicas); placed gangs' members are watched (`members`)."""

from __future__ import annotations

import asyncio
import gc
import logging
import random
import secrets
import time

import msgspec
from prometheus_client import Counter, Gauge, Histogram

from libs.bus import Bus, Endpoint, Versioned
from libs.bus.batch import Coalescing
from libs.contracts import names
from libs.contracts.api import ApplyReply, ApplyRequest, DeleteReply, DeleteRequest
from libs.contracts.base import now
from libs.contracts.epochs import Epoch, Lease
from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.fleet import NodeHealth, NodeRecord
from libs.contracts.jobs import FINISHED_PHASES, Job, Phase
from libs.contracts.placer import PlacerConfig
from libs.contracts.qualify import Qualification, qualified_pairs
from libs.contracts.relay import RelayRecord
from libs.jobs import lifecycle
from libs.jobs.store import publish_recent_events
from libs.mesh import MeshIdentity
from libs.runtime.tasks import TaskSet, cancel_and_wait
from libs.runtime.version import VERSION
from libs.runtime.workqueue import BatchWorkQueue
from services.placer import admission
from services.placer.cluster import ClusterView, follow_cordons
from services.placer.commit import Committer, Placement
from services.placer.jobcache import JobCache
from services.placer.members import MemberWatch
from services.placer.orphans import STALE_SECONDS, OrphanSweep, Released
from services.placer.planner import Exclusions, Plan, Planner, Shortfall
from services.placer.relays import LiveRelays

log = logging.getLogger("nodus.placer")

DECISIONS = Counter("nodus_placer_decisions_total", "Placement outcomes", ["outcome"])
ADMISSIONS = Counter("nodus_placer_admissions_total", "Apply requests by outcome", ["outcome"])
PLACE_SECONDS = Histogram(
    "nodus_placer_place_seconds",
    "Time to commit one placement",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5),
)
FREE_NODES = Gauge("nodus_placer_free_nodes", "Live, healthy machines no gang holds")
WAITING_JOBS = Gauge("nodus_placer_waiting_jobs", "Admitted jobs waiting for capacity")

STALE_SWEEP_TICKS = 15  # seconds between sweeps of what unfinished commits left


def _race_backoff(attempt: int) -> float:
    """How long a placement that lost a race waits before planning again: random, and longer
    after each loss. Two replicas that both took a job (a takeover) and lost to each other
    retried in step, each woken by the other's release, and split the gang's machines between
    them for minutes (chaos seed 528796)."""
    return random.uniform(0.0, min(1.0, 0.02 * 2**attempt))


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
        self.epochs = bus.bucket(names.BUCKET_EPOCHS, Epoch)
        self.qualifications = bus.bucket(names.BUCKET_QUALIFICATIONS, Qualification)
        self.cache = JobCache()
        self.relays = LiveRelays()
        self._far_relays: set[tuple[str, str]] = set()  # relays near no machine, said once
        self.relay_records = bus.bucket(names.BUCKET_RELAYS, RelayRecord)
        self.committer = Committer(bus, config, self.view, self.replica, self.cache, self.relays)
        self.admissions = Coalescing(self.committer.batches)
        self.members = MemberWatch(bus, self.view)
        self.orphans = OrphanSweep(bus, self.committer.teardown)
        # Jobs placed in batches, several batches at once: planning is synchronous and
        # reserves its machines in the view before the first await, so concurrent batches never
        # pick the same ones.
        self.queue = BatchWorkQueue(
            self._place_batch, config.placement_concurrency, config.placement_batch, log
        )
        self._waiting: set[str] = set()  # admitted, no capacity yet
        self._tasks: list[asyncio.Task[None]] = []
        self._background = TaskSet("placer background", log)
        self._feasible_cache: dict[bytes, NodusError | None] = {}
        self._feasible_version = -1

    # -- start and stop ------------------------------------------------------------------------

    async def start(self) -> None:
        # One pass per bucket: each watch delivers the current values, then every change. The
        # cordons and qualifications are read before the first apply is answered: a placer
        # that starts must not place a job on a machine under repair, nor refuse one whose
        # pairs were measured.
        caught_up = [asyncio.Event() for _ in range(6)]
        self._tasks = [
            asyncio.create_task(self._watch_nodes(caught_up[0])),
            asyncio.create_task(self._watch_health(caught_up[1])),
            asyncio.create_task(self._watch_leases(caught_up[2])),
            asyncio.create_task(
                follow_cordons(self.bus, self.view, self._capacity_changed, caught_up[3])
            ),
            asyncio.create_task(self._watch_qualifications(caught_up[4])),
            asyncio.create_task(self._watch_relays(caught_up[5])),
        ]
        await asyncio.gather(*(event.wait() for event in caught_up))
        # The fleet's records, just loaded, live as long as the placer: kept out of the
        # collector's walks (each walked them all: a tenth of a burst's CPU at 10,000 machines).
        gc.freeze()
        self._tasks += [
            asyncio.create_task(self._watch_jobs()),
            asyncio.create_task(self._sweeper()),
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
        self.queue.start()
        self._background.spawn(publish_recent_events(self.bus), name="recent events")
        log.info("placer %s ready with %d machines", self.replica, len(self.view.records))

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)
        await self.queue.stop()
        await self._background.close()
        await self.committer.close()

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
        step = lifecycle.admitted(now(), self.replica)
        job = msgspec.structs.replace(spec_only, status=step.status)
        # A new job: one write, no read first; the applies of one pass leave together.
        revision = await self.admissions.create(self.jobs, job.key, job)
        if revision is None:
            existing = await self.jobs.get(spec_only.key)
            if existing is None:
                raise NodusError(
                    ErrorCode.ALREADY_EXISTS, f"job {job.key} was created concurrently"
                )
            if msgspec.json.encode(existing.value.spec) != msgspec.json.encode(spec_only.spec):
                raise NodusError(
                    ErrorCode.IMMUTABLE,
                    f"job {spec_only.key} exists with another spec; a gang's spec cannot change "
                    "while it lives: delete it first",
                )
            ADMISSIONS.labels("unchanged").inc()
            return ApplyReply(job=existing.value, created=False)
        self.cache.saw(Versioned(job.key, job, revision))
        ADMISSIONS.labels("admitted").inc()
        self.committer.announce(job, step)
        self.queue.mark(job.key)
        return ApplyReply(job=job, created=True)

    def _check_feasible(self, job: Job) -> None:
        """Could the job run on the registered fleet if it were idle? Cached per spec shape."""
        if self._feasible_version != self.view.inventory_version:
            self._feasible_cache.clear()
            self._feasible_version = self.view.inventory_version
        # What the planner reads of a new job (its org is checked statically, not planned on).
        shape = msgspec.json.encode((job.spec.accelerators, job.spec.distributed, job.spec.qualify))
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
                await self.committer.teardown(job.key, job.status.epoch)
            if await self.jobs.delete(key, current.revision):
                self._waiting.discard(key)
                self.committer.announce(job, lifecycle.deleted(job.status))
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

    async def _watch_relays(self, caught_up: asyncio.Event) -> None:
        """The relays' heartbeats: a Relayed gang gets two live ones, nearest and least loaded."""
        async for change in self.relay_records.watch(caught_up=caught_up):
            self.relays.set(change.key, change.value)

    async def _watch_qualifications(self, caught_up: asyncio.Event) -> None:
        """G21: the pairs `nodus qualify` measured are qualified for their path from now on;
        one that failed its run is not (and a later failure takes the pair back)."""
        measured: dict[str, Qualification] = {}
        async for change in self.qualifications.watch(caught_up=caught_up):
            if change.value is None:
                measured.pop(change.key, None)
            else:
                measured[change.key] = change.value
            self.planner.measured = qualified_pairs(measured.values())
            self._feasible_cache.clear()
            self._capacity_changed()

    async def _watch_jobs(self) -> None:
        """Another replica's Pending job is taken over once it has waited `takeover_seconds`."""
        async for change in self.jobs.watch():
            job = change.value
            if job is None:
                self.cache.forget(change.key)
            elif not self.cache.saw(Versioned(change.key, job, change.revision)):
                # This replica wrote a newer version already (a burst's Pending arrives after
                # it was placed); the watch brings that version next.
                continue
            self.members.track(change.key, job)
            if job is not None and job.status.phase in FINISHED_PHASES and job.status.epoch:
                self._finished(job)
            if job is None or job.status.phase is not Phase.PENDING:
                continue
            if job.status.placed_by == self.replica:
                if not self.queue.working_on(change.key):
                    # Sent back for a new epoch (probe failed, member lost), or left Pending
                    # by this replica's previous life, killed mid-placement (chaos seed
                    # 276742): nobody else will place it.
                    self.queue.mark(change.key)
                continue
            asyncio.get_running_loop().call_later(
                self.config.takeover_seconds, self.queue.mark, change.key
            )

    async def _sweeper(self) -> None:
        ticks = 0
        while True:
            await asyncio.sleep(1.0)
            ticks += 1
            if self.view.sweep(now()):
                self._capacity_changed()
            await self.members.check()
            FREE_NODES.set(len(self.view.free))
            WAITING_JOBS.set(len(self._waiting))
            if ticks % STALE_SWEEP_TICKS == 0:
                try:
                    await self.release_orphans()
                except Exception as error:  # the next sweep tries again
                    log.warning("sweep of what unfinished commits left failed: %s", error)
                self._warn_of_far_relays()

    def _warn_of_far_relays(self) -> None:
        """Say once of each relay (and region) that no machine is near: its region is not
        one the fleet has, and it is chosen only when no relay is nearer."""
        for relay in self.relays.near_no_machine(self.view.region_classes, now()):
            if (relay.name, relay.region) not in self._far_relays:
                self._far_relays.add((relay.name, relay.region))
                log.warning(
                    "relay %s has region %s, which is no region or region class of a "
                    "registered machine: no gang is near it (a mistyped --region?)",
                    relay.name,
                    relay.region,
                )

    def _finished(self, job: Job) -> None:
        """A gang that ended gives its machines back: its epoch is fenced and torn down (the
        job record, its status and the ranks' logs stay)."""

        async def release() -> None:
            stored = await self.epochs.get(names.epoch_key(job.key, job.status.epoch))
            if stored is not None and not stored.value.fenced:
                await self.committer.teardown(job.key, job.status.epoch)

        self._background.spawn(release(), name=f"release {job.key}")

    async def release_orphans(self, grace_seconds: float = STALE_SECONDS) -> Released:
        """Free what commits that never finished left (see services/placer/orphans.py); the
        jobs waiting try again (a freed address claim changes no lease the watch would see)."""
        released = await self.orphans.release(grace_seconds)
        if released != Released():
            self._capacity_changed()
        return released

    def _retry(self, key: str) -> None:
        self._waiting.add(key)
        self.queue.mark(key)

    def _capacity_changed(self) -> None:
        for key in list(self._waiting):
            self.queue.mark(key)

    # -- placement -----------------------------------------------------------------------------

    async def _place_batch(self, keys: list[str]) -> None:
        """Place the jobs waiting, together: each planned in turn against the view (its
        machines reserved before the next is planned, so none is picked twice), then all
        committed at once, a round trip per step for the whole batch. A job that lost a race
        is planned again with a fresher view, up to `max_attempts` times."""
        started = time.perf_counter()
        exclusions = {key: Exclusions() for key in keys}
        todo = keys
        undecided = set(keys)

        def decided(key: str, outcome: str | None) -> None:
            if outcome is not None:
                DECISIONS.labels(outcome).inc()
            if key in undecided:
                undecided.discard(key)
                PLACE_SECONDS.observe(time.perf_counter() - started)

        try:
            for attempt in range(self.config.max_attempts):
                if not todo:
                    return
                if attempt:
                    await asyncio.sleep(_race_backoff(attempt))
                ready = await self._ready_to_plan(todo, attempt)
                placements, unschedulable = self._plan_batch(ready, exclusions)
                committed, *explained = await asyncio.gather(
                    self.committer.commit_all(placements),
                    *(
                        self.committer.set_gang_ready(current, "False", "Unschedulable", why)
                        for current, why in unschedulable
                    ),
                    return_exceptions=True,
                )
                for (current, _), error in zip(unschedulable, explained, strict=True):
                    decided(current.key, "unschedulable")
                    if isinstance(error, BaseException):
                        log.warning("%s: Unschedulable not written: %s", current.key, error)
                if isinstance(committed, BaseException):
                    raise committed
                for placement in placements:
                    if not placement.lost:
                        self.members.placed(placement.record)
                        self._waiting.discard(placement.gang)
                        decided(placement.gang, "placed")
                todo = [placement.gang for placement in placements if placement.lost]
            for key in todo:
                # Not at the next capacity change, which the rival's own release makes at once.
                asyncio.get_running_loop().call_later(
                    _race_backoff(self.config.max_attempts), self._retry, key
                )
                decided(key, "gave_up")
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception(
                "placing %s failed; will retry on the next capacity change", ", ".join(todo)
            )
            self._waiting.update(todo)
        finally:
            for key in list(undecided):  # no longer Pending, or failed: a call all the same
                decided(key, None)

    async def _ready_to_plan(
        self, keys: list[str], attempt: int
    ) -> list[tuple[Versioned[Job], int]]:
        """The jobs still Pending, each with the epoch its placement will be, in `keys` order.
        The first attempt starts from what this replica knows (no read, no wait: a batch is
        planned in the order its jobs were queued); a race lost (its compare-and-set refused)
        reads the job again, and its next epoch is past any fenced one."""

        async def ready(key: str) -> tuple[Versioned[Job], int] | None:
            current = self.cache.pending(key) if attempt == 0 else None
            if current is None:
                current = await self.jobs.get(key)
            if current is None or current.value.status.phase is not Phase.PENDING:
                self._waiting.discard(key)
                return None
            old_epoch = current.value.status.epoch
            if old_epoch:
                # A restart fences the old epoch first (G9): its members reach nobody any more,
                # its machines are free again; then the next epoch is placed.
                await self.committer.teardown(key, old_epoch)
            if attempt == 0:
                return current, current.value.status.epoch + 1
            return current, await self.committer.next_epoch(current.value)

        known: dict[str, tuple[Versioned[Job], int]] = {}
        slow: list[str] = []
        for key in keys:
            cached = self.cache.pending(key) if attempt == 0 else None
            if cached is not None and not cached.value.status.epoch:
                known[key] = (cached, 1)  # a new job: its first epoch, nothing to read
            else:
                slow.append(key)
        if slow:
            found = await asyncio.gather(*(ready(key) for key in slow), return_exceptions=True)
            for key, outcome in zip(slow, found, strict=True):
                if isinstance(outcome, asyncio.CancelledError):
                    raise outcome
                if isinstance(outcome, BaseException):
                    log.error(
                        "placing %s failed; will retry on the next capacity change",
                        key,
                        exc_info=outcome,
                    )
                    self._waiting.add(key)
                elif outcome is not None:
                    known[key] = outcome
        return [known[key] for key in keys if key in known]

    def _plan_batch(
        self, ready: list[tuple[Versioned[Job], int]], exclusions: dict[str, Exclusions]
    ) -> tuple[list[Placement], list[tuple[Versioned[Job], str]]]:
        """Plan each job in turn against the view; between a plan and its machines' reservation
        nothing waits, so the next plan (and this replica's other batches) skip them. A job
        that fits nowhere waits for capacity, with the reasons to write on it."""
        placements: list[Placement] = []
        unschedulable: list[tuple[Versioned[Job], str]] = []
        for current, epoch in ready:
            key = current.key
            mesh = MeshIdentity()
            plan, shortfalls = self._plan_avoiding(current.value, exclusions[key], mesh.mesh_id)
            if plan is None:
                self._waiting.add(key)
                unschedulable.append((current, "; ".join(s.message for s in shortfalls)))
                continue
            try:
                placements.append(
                    self.committer.prepare(current, plan, mesh, exclusions[key], epoch)
                )
            except Exception:
                log.exception("placing %s failed; will retry on the next capacity change", key)
                self._waiting.add(key)
        return placements, unschedulable

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
                log.info(
                    "%s: placed on %s again: no other machine fits (%s)",
                    job.key,
                    ", ".join(again),
                    "; ".join(s.message for s in shortfalls),
                )
        return plan, shortfalls

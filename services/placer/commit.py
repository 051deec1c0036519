"""Committing a placement and undoing one: the machines' leases (and on Relayed the
addresses) taken, the epoch persisted before anything names it (C2/G9), the members' join keys
granted, then the job says Placed, each by compare-and-set so that replicas racing produce one
outcome (R14); and an epoch fenced and everything it held freed (teardown)."""

from __future__ import annotations

import asyncio
import collections
import logging
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

import msgspec
from prometheus_client import Counter

from libs.bus import Bus, Versioned, check_plan_generations
from libs.bus.batch import Batches
from libs.contracts import names
from libs.contracts.base import encode, now
from libs.contracts.bounds import RELATIVE_TO_DIRECT, derive
from libs.contracts.epochs import (
    CAPABILITY_JOIN_KEY_MEMBERS,
    AddressClaim,
    Epoch,
    EpochMember,
    JoinKeyGrant,
    JoinKeyGrantWire,
    Lease,
    Ranktable,
    RanktableEntry,
)
from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.fleet import NodeRecord
from libs.contracts.jobs import Estimate, GangMember, GangStatus, Job, JobEvent, PathClass
from libs.contracts.placer import PlacerConfig
from libs.contracts.relay import CAPABILITY_EPOCH_RELAYS
from libs.jobs import lifecycle
from libs.jobs.relays import Home, Whereabouts, weighed
from libs.jobs.store import event_message
from libs.mesh import MeshIdentity
from libs.runtime.tasks import TaskSet
from services.placer.cluster import ClusterView
from services.placer.environment import device_names, rank_environments
from services.placer.invariants import check_plan
from services.placer.jobcache import JobCache
from services.placer.planner import Exclusions, Plan
from services.placer.relays import LiveRelays, RelayChoice

log = logging.getLogger("nodus.placer")

CONFLICTS = Counter("nodus_placer_conflicts_total", "Compare-and-set races lost", ["what"])

RELAYED_WARNING = (
    "Relayed is assumed 4x slower than Direct until its qualification benchmark publishes "
    "measured numbers; it suits small models and jobs that communicate little"
)


class LostRace(Exception):
    """A race lost mid-commit: plan again with a fresher view."""


@dataclass(slots=True)
class Placement:
    """One job's plan on its way to the bus: its machines reserved in the view, its records
    made; what it took so far, and whether it lost a race (then it took nothing)."""

    current: Versioned[Job]
    plan: Plan
    mesh: MeshIdentity
    exclusions: Exclusions
    record: Epoch
    record_json: bytes  # the epoch record encoded, once: written as itself and in each grant
    lease: Lease
    slots: list[int]  # each member's relay slot (Relayed only)
    relays: list[str]  # the gang's two relays, when its agents and relays read them
    held: dict[str, int] = field(default_factory=dict)  # node -> lease revision
    claimed: list[tuple[str, int]] = field(default_factory=list)  # address key, revision
    lost: bool = False

    @property
    def gang(self) -> str:
        return self.record.gang


class Committer:
    """One replica's writer of placements; the view is the replica's own (machines are
    reserved in it before the first await, so its concurrent commits never pick the same)."""

    def __init__(
        self,
        bus: Bus,
        config: PlacerConfig,
        view: ClusterView,
        replica: str,
        cache: JobCache,
        relays: LiveRelays | None = None,
    ) -> None:
        self.bus = bus
        self.cache = cache  # what this replica writes of a job, known before its watch says
        self.relays = relays or LiveRelays()  # the placer's watch keeps it
        self.config = config
        self.view = view
        self.replica = replica
        self.jobs = bus.bucket(names.BUCKET_JOBS, Job)
        self.leases = bus.bucket(names.BUCKET_LEASES, Lease)
        self.addresses = bus.bucket(names.BUCKET_ADDRESSES, AddressClaim)
        self.epochs = bus.bucket(names.BUCKET_EPOCHS, Epoch)
        self.joinkeys = bus.bucket(names.BUCKET_JOINKEYS, JoinKeyGrant)
        self.ranktables = bus.bucket(names.BUCKET_RANKTABLES, Ranktable)
        self.events = TaskSet("placer events", log)
        self.batches = Batches(bus)  # a step's writes for every placement, sent as one
        self._events: list[tuple[str, JobEvent, str]] = []  # announced, not yet sent
        # Each gang's load on its relays while it is committed (its job does not say so yet).
        self._relaying: dict[str, collections.Counter[Home]] = {}
        self._committing: collections.Counter[Home] = collections.Counter()  # all of them

    async def close(self) -> None:
        await self.events.close()

    def announce(self, job: Job, step: lifecycle.Step) -> None:
        """Publish a step's event in the background: the KV record is the truth, and nobody
        waits on the event's acknowledgement (a lost event is logged). Events announced in one
        pass of the loop leave together, as one batch."""
        if step.event is None:
            return
        message = event_message(job.key, job.status.epoch, step.status)
        if message is None:
            return
        self._events.append(message)
        if len(self._events) == 1:
            self.events.spawn(self._publish_events(), name="events")

    async def _publish_events(self) -> None:
        await asyncio.sleep(0)  # the rest of this pass's events join the batch
        messages, self._events = self._events, []
        batch = self.batches.batch()
        for subject, body, msg_id in messages:
            batch.publish(subject, body, msg_id)
        try:
            await batch.send()
        except Exception as error:  # the job records are the truth; the events their audit
            log.warning("%d events not published: %s", len(messages), error)

    # -- committing placements -------------------------------------------------------------------

    def prepare(
        self,
        current: Versioned[Job],
        plan: Plan,
        mesh: MeshIdentity,
        exclusions: Exclusions,
        epoch: int,
    ) -> Placement:
        """A plan made ready to commit, its machines reserved in the view at once (the next
        plan of this replica skips them; nothing may wait between a plan and this)."""
        job = current.value
        records = {node: self.view.records[node] for node in plan.nodes}
        problems = check_plan(plan, records, job)
        if problems:  # the planner's own invariants: never commit a plan that breaks them
            raise NodusError(ErrorCode.INTERNAL, f"plan for {job.key} breaks {problems}")
        t = now()
        lease = Lease(gang=job.key, epoch=epoch, placer=self.replica, created_time=t)
        for node in plan.nodes:
            self.view.set_lease(node, lease, t)
        choice = RelayChoice([], [], [])
        if plan.path is PathClass.RELAYED:
            choice = self._relay_choice(job.key, plan, t, home=True)
        elif plan.path is PathClass.DIRECT:  # the relays a pair falls back to (G13)
            choice = self._relay_choice(job.key, plan, t, home=False)
        record = self._epoch_record(job, plan, records, epoch, mesh, t, choice)
        return Placement(
            current,
            plan,
            mesh,
            exclusions,
            record,
            encode(record),
            lease,
            choice.slots,
            choice.relays,
        )

    async def commit_all(self, placements: list[Placement]) -> None:
        """Commit prepared plans together, each in its order: the machines (and on Relayed the
        addresses), the epoch, the members' join keys, then the job says Placed. Each step is
        one batch of writes for every placement still going: a round trip per step, not per
        record. A placement that loses a race on the way gives back what it took and says so
        (`lost`); an error gives back what every placement took, and is raised."""
        try:
            try:
                await self._take_leases(placements)
                claims = await asyncio.gather(
                    *(
                        self._claim_or_release(p)
                        for p in placements
                        if not p.lost and p.plan.path is PathClass.RELAYED
                    ),
                    return_exceptions=True,  # every claim settled before any is given back
                )
                for outcome in claims:
                    if isinstance(outcome, BaseException):
                        raise outcome
                await self._persist_epochs([p for p in placements if not p.lost])
            except BaseException:
                await asyncio.shield(self._release_all([p for p in placements if not p.lost]))
                raise
            going = [p for p in placements if not p.lost]
            await self._grant_join_keys(going)
            await self._mark_placed(going)
        finally:
            for placement in placements:
                self._committing.subtract(self._relaying.pop(placement.gang, {}))

    async def _take_leases(self, placements: list[Placement]) -> None:
        """Every machine's lease, by compare-and-set: two replicas never hold one (R14). A
        gang that misses one gives back the others and plans again."""
        batch = self.batches.batch()
        slots = []
        for p in placements:
            lease = encode(p.lease)  # one record for every machine of the gang
            slots.append([batch.create_encoded(self.leases, node, lease) for node in p.plan.nodes])
        revisions = await batch.send()
        lost: list[Placement] = []
        for placement, indexes in zip(placements, slots, strict=True):
            for node, index in zip(placement.plan.nodes, indexes, strict=True):
                revision = revisions[index]
                if revision is not None:
                    placement.held[node] = revision
            if len(placement.held) != len(placement.plan.nodes):
                CONFLICTS.labels("lease").inc()
                missing = [n for n in placement.plan.nodes if n not in placement.held]
                log.debug("%s lost leases on %s; planning again", placement.gang, missing)
                lost.append(placement)
        # The machines another holds stay marked in the view until their watch says.
        await self._release_all(lost)

    async def _claim_or_release(self, placement: Placement) -> None:
        try:
            await self._claim_addresses(placement)
        except LostRace:
            await self._release_all([placement])

    async def _persist_epochs(self, placements: list[Placement]) -> None:
        """C2/G9: each epoch persisted before anything that names it leaves; a replica that
        persisted the same epoch first wins the job."""
        batch = self.batches.batch()
        for p in placements:
            batch.create_encoded(
                self.epochs, names.epoch_key(p.gang, p.record.epoch), p.record_json
            )
        revisions = await batch.send()
        lost = [p for p, revision in zip(placements, revisions, strict=True) if revision is None]
        for _ in lost:
            CONFLICTS.labels("epoch").inc()
        await self._release_all(lost)

    async def _grant_join_keys(self, placements: list[Placement]) -> None:
        """The epoch's join key, under each member's own key (S1): one key naming every
        member, the same grant for each, encoded once; a one-member key each when a member's
        agent reads no other."""
        batch = self.batches.batch()
        for p in placements:
            record = p.record
            gang, epoch, expires = record.gang, record.epoch, record.join_keys_expire_time
            nodes = [m.node for m in record.members]
            if all(self._reads_shared_keys(node) for node in nodes):
                tokens = dict.fromkeys(nodes, p.mesh.mint(gang, epoch, nodes, expires))
            else:
                tokens = p.mesh.mint_each(gang, epoch, nodes, expires)
            epoch_json = msgspec.Raw(p.record_json)
            grants: dict[str, bytes] = {}  # token -> its grant, encoded once
            for node, token in tokens.items():
                if token not in grants:
                    grants[token] = encode(JoinKeyGrantWire(token, p.mesh.verify_key, epoch_json))
                batch.put_encoded(
                    self.joinkeys, names.joinkey_key(node, gang, epoch), grants[token]
                )
        await batch.send()

    def _reads_shared_keys(self, node: str) -> bool:
        record = self.view.records.get(node)
        return record is not None and CAPABILITY_JOIN_KEY_MEMBERS in record.capabilities

    async def _mark_placed(self, placements: list[Placement]) -> None:
        """Each job says Placed, unless it changed meanwhile: then its epoch is undone."""
        batch = self.batches.batch()
        steps: list[tuple[lifecycle.Step, Job, Ranktable]] = []
        for p in placements:
            record = p.record
            step = lifecycle.placed(
                p.current.value.status,
                record.epoch,
                self._gang_status(p.plan, p.slots, p.relays),
                self.replica,
                record.created_time,
            )
            placed = msgspec.structs.replace(p.current.value, status=step.status)
            ranktable = self._ranktable(placed, record)
            # C2: every part of the plan names one generation, checked before it says Placed.
            check_plan_generations(
                p.gang,
                [
                    ("epoch", record.epoch),
                    ("lease", p.lease.epoch),
                    ("job", step.status.epoch),
                    ("ranktable", ranktable.epoch),
                ],
            )
            batch.update(self.jobs, p.gang, placed, p.current.revision)
            steps.append((step, placed, ranktable))
        revisions = await batch.send()
        tables = self.batches.batch()
        undone: list[Placement] = []
        for p, (step, placed, ranktable), revision in zip(
            placements, steps, revisions, strict=True
        ):
            if revision is None:
                # Deleted or changed under us: undo this epoch entirely.
                CONFLICTS.labels("job").inc()
                p.lost = True
                undone.append(p)
                continue
            self.cache.saw(Versioned(p.gang, placed, revision))
            tables.put(self.ranktables, p.gang, ranktable)
            self.announce(placed, step)
        await asyncio.gather(
            tables.send(), *(self.teardown(p.gang, p.record.epoch) for p in undone)
        )

    def _relay_choice(self, gang: str, plan: Plan, t: datetime, home: bool) -> RelayChoice:
        """The gang's two relays, the nearest its members and least loaded, and, if `home`,
        each member's home on them, counting the gangs placed and those being committed now
        (their jobs do not say Placed yet), but not this gang's own attempt that lost a race."""
        earlier = self._relaying.pop(gang, None)  # this gang's attempt that lost a race
        if earlier:
            self._committing.subtract(earlier)
        load = self.cache.relay_load(leaving_out=gang)
        load.update(self._committing)
        named = all(
            CAPABILITY_EPOCH_RELAYS in self.view.records[node].capabilities for node in plan.nodes
        )
        inventories = [self.view.records[node].inventory for node in plan.nodes]
        whereabouts = [Whereabouts(i.region, i.region_class) for i in inventories]
        choice = self.relays.choose(whereabouts, load, named, t, home, self.view.region_classes)
        if choice.homes:
            self._relaying[gang] = weighed(choice.homes)
            self._committing.update(self._relaying[gang])
        return choice

    async def next_epoch(self, job: Job) -> int:
        """The job's next epoch number: past any fenced one. A placement whose job record
        changed under it is torn down after its epoch was persisted, so that number is used,
        fenced, while the job still names the one before; epochs are never reused."""
        epoch = job.status.epoch + 1
        while True:
            found = await self.epochs.get(names.epoch_key(job.key, epoch))
            if found is None or not found.value.fenced:
                return epoch  # free, or another replica's live placement (create refuses)
            epoch += 1

    async def _claim_addresses(self, placement: Placement) -> None:
        """G7: no two running Relayed gangs route one address; a collision re-places."""
        current, plan, epoch = placement.current, placement.plan, placement.record.epoch
        gang = current.value.key
        for member in plan.members:
            key = names.address_key(member.address)
            claim = AddressClaim(gang=gang, epoch=epoch, node=member.node, created_time=now())
            revision = await self.addresses.create(key, claim)
            if revision is not None:
                placement.claimed.append((key, revision))
                continue
            holder = await self.addresses.get(key)
            if holder is not None and holder.value.gang == gang and holder.value.epoch < epoch:
                # Our own older epoch's claim: take it over.
                revision = await self.addresses.update(key, claim, holder.revision)
                if revision is not None:
                    placement.claimed.append((key, revision))
                    continue
            if holder is not None and holder.value.gang == gang:
                # This gang's own placement that never finished (its bus failed mid-commit):
                # the placer's sweep frees it, and this job's next attempt gets a new epoch.
                why = (
                    f"address {member.address} of {member.node} is still claimed by this "
                    f"gang's epoch {holder.value.epoch}, whose placement did not finish; it is "
                    "freed within a minute"
                )
            else:
                other = holder.value.gang if holder else "another gang"
                why = (
                    f"address {member.address} of {member.node} is routed by running Relayed "
                    f"gang {other}; placing the members again"
                )
            placement.exclusions.addresses.add(member.address)
            CONFLICTS.labels("address").inc()
            await self.set_gang_ready(current, "False", "IPCollision", why)
            raise LostRace

    async def _release_all(self, placements: list[Placement]) -> None:
        """Give back what these placements took (claims, then leases) and say they lost."""
        if not placements:
            return
        batch = self.batches.batch()
        for p in placements:
            p.lost = True
            for key, revision in p.claimed:
                batch.delete(self.addresses, key, revision)
            for node, revision in p.held.items():
                batch.delete(self.leases, node, revision)
        await batch.send()
        t = now()
        for p in placements:
            for node in p.held:
                self.view.set_lease(node, None, t)
            p.held.clear()
            p.claimed.clear()

    async def teardown(self, gang: str, epoch: int) -> None:
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
                if await self.leases.delete(member.node, lease.revision):
                    # Free in the view at once: the gang's next epoch is planned right after
                    # this, before the watch says so (its own machines looked taken, and a
                    # member it lost was placed again in their stead: CI, test_e).
                    self.view.set_lease(member.node, None, now())
        ranktable = await self.ranktables.get(gang)
        if ranktable and ranktable.value.epoch == epoch:
            await self.ranktables.delete(gang, ranktable.revision)

    # -- records ------------------------------------------------------------------------------

    def _gang_status(self, plan: Plan, slots: list[int], relays: list[str]) -> GangStatus:
        factor = RELATIVE_TO_DIRECT[plan.path]
        return GangStatus(
            transport=plan.path,
            members=[
                GangMember(
                    rank=m.rank,
                    node=m.node,
                    address=m.address,
                    relay_slot=slots[i] if slots else None,
                )
                for i, m in enumerate(plan.members)
            ],
            estimate=Estimate(
                relative_to_direct=factor,
                warning=RELAYED_WARNING if plan.path is PathClass.RELAYED else None,
            ),
            relays=relays,
        )

    def _epoch_record(
        self,
        job: Job,
        plan: Plan,
        records: dict[str, NodeRecord],
        epoch: int,
        mesh: MeshIdentity,
        t: datetime,
        relays: RelayChoice,
    ) -> Epoch:
        devices = {m.node: device_names(records[m.node]) for m in plan.members}
        envs = rank_environments(
            job,
            plan,
            records,
            epoch,
            self.config.master_port,
            self.config.shim_path,
            self.config.checkpoint_root,
            devices,
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
                    devices=devices[m.node],
                    env=envs[m.rank],
                    boot_id=records[m.node].boot_id,
                    relay_slot=relays.slots[i] if relays.slots else 0,
                )
                for i, m in enumerate(plan.members)
            ],
            bounds=bounds,
            created_time=t,
            join_keys_expire_time=MeshIdentity.expiry(t, bounds.join_key_ttl_seconds),
            placed_by=self.replica,
            relays=relays.relays,
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

    async def set_gang_ready(
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
        revision = await self.jobs.update(current.key, job, current.revision)
        if revision is None:
            # Not written: its event must not leave either. It carries the number of the
            # job's next event, and the stream, which keeps the first of an id, would drop
            # the real one (chaos seed 276742: another replica's Placed, lost so).
            return
        self.cache.saw(Versioned(current.key, job, revision))
        self.announce(job, step)

"""Committing a placement and undoing one: the machines' leases (and on Relayed the
addresses) taken, the epoch persisted before anything names it (C2/G9), the members' join keys
granted, then the job says Placed, each by compare-and-set so that replicas racing produce one
outcome (R14); and an epoch fenced and everything it held freed (teardown)."""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime
from typing import Literal

import msgspec
from prometheus_client import Counter

from libs.bus import Bus, Versioned, check_plan_generations
from libs.contracts import names
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
from libs.contracts.fleet import NodeRecord
from libs.contracts.jobs import Estimate, GangMember, GangStatus, Job, PathClass
from libs.contracts.placer import PlacerConfig
from libs.jobs import lifecycle
from libs.jobs.store import publish
from libs.mesh import MeshIdentity
from libs.runtime.tasks import TaskSet
from services.placer.cluster import ClusterView
from services.placer.environment import device_names, rank_environments
from services.placer.invariants import check_plan
from services.placer.jobcache import JobCache
from services.placer.planner import Exclusions, Plan

log = logging.getLogger("nodus.placer")

CONFLICTS = Counter("nodus_placer_conflicts_total", "Compare-and-set races lost", ["what"])

RELAYED_WARNING = (
    "Relayed is assumed 4x slower than Direct until its qualification benchmark publishes "
    "measured numbers; it suits small models and jobs that communicate little"
)


class LostRace(Exception):
    """A race lost mid-commit: plan again with a fresher view."""


class Committer:
    """One replica's writer of placements; the view is the replica's own (machines are
    reserved in it before the first await, so its concurrent commits never pick the same)."""

    def __init__(
        self, bus: Bus, config: PlacerConfig, view: ClusterView, replica: str, cache: JobCache
    ) -> None:
        self.bus = bus
        self.cache = cache  # what this replica writes of a job, known before its watch says
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
        self._relaying: dict[str, list[int]] = {}  # gang -> its members' relay slots, mid-commit

    async def close(self) -> None:
        await self.events.close()

    def announce(self, job: Job, step: lifecycle.Step) -> None:
        """Publish a step's event in the background: the KV record is the truth, and nobody
        waits on the event's acknowledgement (a lost event is logged)."""
        if step.event is not None:
            self.events.spawn(
                publish(self.bus, job.key, job.status.epoch, step), name=f"event {job.key}"
            )

    async def commit(
        self,
        current: Versioned[Job],
        plan: Plan,
        mesh: MeshIdentity,
        exclusions: Exclusions,
        epoch: int,
    ) -> None:
        """Commit a plan in its order: the machines (and on Relayed the addresses), the epoch,
        the members' join keys, then the job says Placed. A race lost raises LostRace."""
        job = current.value
        records = {node: self.view.records[node] for node in plan.nodes}
        problems = check_plan(plan, records, job)
        if problems:  # the planner's own invariants: never commit a plan that breaks them
            raise NodusError(ErrorCode.INTERNAL, f"plan for {job.key} breaks {problems}")
        t = now()
        relayed = plan.path is PathClass.RELAYED
        slots = self._relay_slots(job.key, len(plan.members)) if relayed else []
        record = self._epoch_record(job, plan, records, epoch, mesh, t, slots)
        lease = Lease(gang=job.key, epoch=epoch, placer=self.replica, created_time=t)
        try:
            await self._persist_epoch(current, plan, record, lease, exclusions)
            await self._grant_join_keys(record, mesh)
            await self._mark_placed(current, plan, record, lease, slots)
        finally:
            self._relaying.pop(job.key, None)

    def _relay_slots(self, gang: str, members: int) -> list[int]:
        """Each member's relay slot, in rank order: the slot with the fewest Relayed members,
        counting the gangs placed, those being committed now (their jobs do not say Placed
        yet) and this gang's members before it; ties go to the first."""
        counts = self.cache.relayed_members(leaving_out=gang)
        for other, taken in self._relaying.items():
            if other != gang:
                for slot in taken:
                    counts[slot] += 1
        slots = []
        for _ in range(members):
            slot = counts.index(min(counts))
            counts[slot] += 1
            slots.append(slot)
        self._relaying[gang] = slots
        return slots

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
                raise LostRace
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
        self, current: Versioned[Job], plan: Plan, record: Epoch, lease: Lease, slots: list[int]
    ) -> None:
        """The job says Placed, unless it changed meanwhile: then the epoch is undone."""
        gang, epoch = record.gang, record.epoch
        step = lifecycle.placed(
            current.value.status,
            epoch,
            self._gang_status(plan, slots),
            self.replica,
            record.created_time,
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
        revision = await self.jobs.update(gang, placed, current.revision)
        if revision is None:
            # Deleted or changed under us: undo this epoch entirely.
            CONFLICTS.labels("job").inc()
            await self.teardown(gang, epoch)
            raise LostRace
        self.cache.saw(Versioned(gang, placed, revision))
        await self.ranktables.put(gang, ranktable)
        self.announce(placed, step)

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
            raise LostRace
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
            await self.set_gang_ready(
                current,
                "False",
                "IPCollision",
                f"address {member.address} of {member.node} is routed by running Relayed gang "
                f"{other}; placing the members again",
            )
            raise LostRace

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
                await self.leases.delete(member.node, lease.revision)
        ranktable = await self.ranktables.get(gang)
        if ranktable and ranktable.value.epoch == epoch:
            await self.ranktables.delete(gang, ranktable.revision)

    # -- records ------------------------------------------------------------------------------

    def _gang_status(self, plan: Plan, slots: list[int]) -> GangStatus:
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
        )

    def _epoch_record(
        self,
        job: Job,
        plan: Plan,
        records: dict[str, NodeRecord],
        epoch: int,
        mesh: MeshIdentity,
        t: datetime,
        relay_slots: list[int],
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
                    relay_slot=relay_slots[i] if relay_slots else 0,
                )
                for i, m in enumerate(plan.members)
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

"""What a commit that never finished leaves behind, freed: epochs no job names, and the leases
and address claims no live epoch explains. A placer killed mid-commit leaves them, and so does
one whose bus failed between two steps of a commit (its epoch persisted, its job never Placed).
Left alone, such an epoch keeps its job from ever being placed again: the next placement gets
the same epoch number, which the orphan holds, and its address claims refuse the job as
colliding with itself (chaos seed 1: 'address 198.19.5.1 of c-0 is routed by running Relayed
gang acme.chaos-10', the job Pending for good)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime

from libs.bus import Bus, Versioned
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.epochs import AddressClaim, Epoch, Lease
from libs.contracts.jobs import FINISHED_PHASES, Job

log = logging.getLogger("nodus.placer")

STALE_SECONDS = 30.0  # a commit never takes this long; older orphans are freed


@dataclass
class Released:
    epochs: int = 0
    leases: int = 0
    addresses: int = 0


def _live(
    gang: str, epoch: int, epochs: dict[str, Versioned[Epoch]], jobs: dict[str, Versioned[Job]]
) -> bool:
    """An epoch is live while it is persisted, not fenced, and its job, not finished, names
    it (a job restarted still names its old epoch until the placer fences it)."""
    stored = epochs.get(names.epoch_key(gang, epoch))
    job = jobs.get(gang)
    return (
        stored is not None
        and not stored.value.fenced
        and job is not None
        and job.value.status.epoch == epoch
        and job.value.status.phase not in FINISHED_PHASES
    )


class OrphanSweep:
    def __init__(self, bus: Bus, teardown: Callable[[str, int], Awaitable[None]]) -> None:
        self.jobs = bus.bucket(names.BUCKET_JOBS, Job)
        self.epochs = bus.bucket(names.BUCKET_EPOCHS, Epoch)
        self.leases = bus.bucket(names.BUCKET_LEASES, Lease)
        self.addresses = bus.bucket(names.BUCKET_ADDRESSES, AddressClaim)
        self.teardown = teardown

    async def _live_after_all(self, gang: str, epoch: int) -> bool:
        """The epoch and job read one by one: anything is freed on their own word, not on a
        read of the whole bucket, which a server's failover can answer short (an agent left a
        running gang on such a read, chaos seed 789536; a lease freed so would let a second
        gang onto a machine in use)."""
        stored = await self.epochs.get(names.epoch_key(gang, epoch))
        job = await self.jobs.get(gang)
        found = {stored.key: stored} if stored else {}
        return _live(gang, epoch, found, {gang: job} if job else {})

    async def release(self, grace_seconds: float = STALE_SECONDS) -> Released:
        """Free what no live epoch explains once it is older than the grace period (a commit
        in flight is younger): an orphaned epoch is fenced and torn down (its join keys,
        claims and leases with it), then leases and claims of no live epoch are deleted."""
        released = Released()
        t = now()

        def old(created: datetime | None) -> bool:
            return created is None or (t - created).total_seconds() >= grace_seconds

        epochs = await self.epochs.snapshot()
        jobs = await self.jobs.snapshot()
        for stored in epochs.values():
            record = stored.value
            if record.fenced or _live(record.gang, record.epoch, epochs, jobs):
                continue
            if not old(record.created_time):
                continue
            if await self._live_after_all(record.gang, record.epoch):
                continue
            await self.teardown(record.gang, record.epoch)
            released.epochs += 1
            log.info(
                "tore down orphaned epoch %d of %s: its job never named it, or no longer does",
                record.epoch,
                record.gang,
            )
        if released.epochs:
            epochs = await self.epochs.snapshot()  # what the teardowns fenced
        for node, lease in (await self.leases.snapshot()).items():
            held = lease.value
            if _live(held.gang, held.epoch, epochs, jobs) or not old(held.created_time):
                continue
            if await self._live_after_all(held.gang, held.epoch):
                continue
            if await self.leases.delete(node, lease.revision):
                released.leases += 1
                log.info("released stale lease on %s (%s epoch %d)", node, held.gang, held.epoch)
        for key, claim in (await self.addresses.snapshot()).items():
            held_claim = claim.value
            if _live(held_claim.gang, held_claim.epoch, epochs, jobs):
                continue
            if not old(held_claim.created_time):
                continue
            if await self._live_after_all(held_claim.gang, held_claim.epoch):
                continue
            if await self.addresses.delete(key, claim.revision):
                released.addresses += 1
                log.info(
                    "released stale address claim %s (%s epoch %d)",
                    key,
                    held_claim.gang,
                    held_claim.epoch,
                )
        return released

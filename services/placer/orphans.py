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
from libs.bus.kv import Bucket
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


def _live(epoch: int, stored: Versioned[Epoch] | None, job: Versioned[Job] | None) -> bool:
    """An epoch is live while it is persisted, not fenced, and its job, not finished, names
    it (a job restarted still names its old epoch until the placer fences it)."""
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

    async def _orphaned(
        self,
        gang: str,
        epoch: int,
        created: datetime | None,
        read: tuple[dict[str, Versioned[Epoch]], dict[str, Versioned[Job]]],
        grace_seconds: float,
    ) -> bool:
        """No live epoch explains it, it is older than a commit takes, and the epoch and job
        read one by one agree: freed on their own word, not on a read of the whole bucket,
        which a server's failover can answer short (an agent left a running gang on such a
        read, chaos seed 789536; a lease freed so would let a second gang onto a machine in
        use)."""
        epochs, jobs = read
        key = names.epoch_key(gang, epoch)
        if _live(epoch, epochs.get(key), jobs.get(gang)):
            return False
        if created is not None and (now() - created).total_seconds() < grace_seconds:
            return False
        return not _live(epoch, await self.epochs.get(key), await self.jobs.get(gang))

    async def release(self, grace_seconds: float = STALE_SECONDS) -> Released:
        """Free what no live epoch explains once it is older than the grace period (a commit
        in flight is younger): an orphaned epoch is fenced and torn down (its join keys,
        claims and leases with it), then leases and claims of no live epoch are deleted."""
        released = Released()
        read = (await self.epochs.snapshot(), await self.jobs.snapshot())
        for stored in read[0].values():
            record = stored.value
            if record.fenced or not await self._orphaned(
                record.gang, record.epoch, record.created_time, read, grace_seconds
            ):
                continue
            await self.teardown(record.gang, record.epoch)
            released.epochs += 1
            log.info(
                "tore down orphaned epoch %d of %s: its job never named it, or no longer does",
                record.epoch,
                record.gang,
            )
        if released.epochs:
            read = (await self.epochs.snapshot(), read[1])  # what the teardowns fenced
        released.leases = await self._free(self.leases, read, grace_seconds)
        released.addresses = await self._free(self.addresses, read, grace_seconds)
        return released

    async def _free(
        self,
        bucket: Bucket[Lease] | Bucket[AddressClaim],
        read: tuple[dict[str, Versioned[Epoch]], dict[str, Versioned[Job]]],
        grace_seconds: float,
    ) -> int:
        """Delete the leases (or address claims) no live epoch explains; how many."""
        freed = 0
        for key, found in (await bucket.snapshot()).items():
            held = found.value
            if not await self._orphaned(
                held.gang, held.epoch, held.created_time, read, grace_seconds
            ):
                continue
            if await bucket.delete(key, found.revision):
                freed += 1
                log.info("freed %s %s (%s epoch %d)", bucket.name, key, held.gang, held.epoch)
        return freed

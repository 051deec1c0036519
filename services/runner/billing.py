"""The relay bytes a gang is billed (G17), and the late usage that amends a bill already made.

A job is billed when it ends, from every usage record the relays published for it by then. A
record can come later: a relay killed mid-run publishes what its journal kept once it is back,
and a flush can wait out a bus failover. Such a record must not go unbilled, so the stream's
record count per gang is swept every few seconds; a gang whose count moved is followed until
its job has ended, and a finished Relayed job whose bill differs from what the records now
bill (libs/jobs/billing.py) gets the difference, with a `BillingAmended` event. Replicas that sweep at once write the same
bill (a compare-and-set on the job) and the same event (one `Nats-Msg-Id`)."""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta

import msgspec
from nats.errors import Error as NatsError

from libs.bus import Bus
from libs.bus.retry import retrying
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.epochs import Epoch
from libs.contracts.errors import NodusError
from libs.contracts.jobs import FINISHED_PHASES as FINAL
from libs.contracts.jobs import Billing, Job, JobEvent, PathClass
from libs.contracts.relay import UsageRecord
from libs.jobs.billing import billed_bytes

log = logging.getLogger("nodus.runner.billing")

SWEEP_SECONDS = 5.0
# At start, finished jobs this recent are checked once (a record may have come while no
# runner ran); older bills stand unless a new record for them arrives.
RECENT_AT_START = timedelta(minutes=30)


async def relay_bytes(bus: Bus, gang: str) -> int:
    """The relay bytes billed for the gang (billed_bytes), each record of the stream read."""
    records = []
    for msg in await bus.replay(names.USAGE_STREAM, names.usage_subject("*", gang)):
        try:
            records.append(msgspec.json.decode(msg.data, type=UsageRecord))
        except msgspec.ValidationError:
            continue
    return billed_bytes(records).get(gang, 0)


def gang_of(subject: str) -> str:
    """`nodus.usage.<relay>.<org>.<name>` -> `org.name`."""
    return subject.removeprefix(names.USAGE_PREFIX).split(".", 1)[1]


class LateUsage:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.jobs = bus.bucket(names.BUCKET_JOBS, Job)
        self.epochs = bus.bucket(names.BUCKET_EPOCHS, Epoch)
        self._counts: dict[str, int] | None = None  # usage records per gang, last sweep
        self._following: set[str] = set()  # gangs with new records whose job has not ended

    async def run(self) -> None:
        while True:
            try:
                await self.sweep()
            except (NodusError, NatsError, OSError, TimeoutError) as error:
                log.info("late usage not swept (the next sweep tries again): %s", error)
            await asyncio.sleep(SWEEP_SECONDS)

    async def _record_counts(self) -> dict[str, int]:
        info = await retrying(
            lambda: self.bus.js.stream_info(names.USAGE_STREAM, subjects_filter=">"),
            "count usage records",
            self.bus.nc,
        )
        counts: dict[str, int] = {}
        for subject, count in (info.state.subjects or {}).items():
            if subject.startswith(names.USAGE_PREFIX) and subject.count(".") >= 4:
                gang = gang_of(subject)
                counts[gang] = counts.get(gang, 0) + count
        return counts

    async def sweep(self) -> list[str]:
        """One pass; the gangs whose bill it amended."""
        counts = await self._record_counts()
        previous, self._counts = self._counts, counts
        if previous is None:
            since = now() - RECENT_AT_START
            jobs = await self.jobs.snapshot()
            self._following |= {
                key
                for key, job in jobs.items()
                if key in counts
                and (
                    job.value.status.phase not in FINAL
                    or (job.value.status.finished_time or since) > since
                )
            }
        else:
            self._following |= {g for g, n in counts.items() if previous.get(g) != n}
        amended = []
        for gang in sorted(self._following):
            settled = await self._settle(gang)
            if settled is None:
                continue  # still running: its end bills it, or a later sweep amends
            self._following.discard(gang)
            if settled:
                amended.append(gang)
        return amended

    async def _settle(self, gang: str) -> bool | None:
        """None while the job runs; else whether its bill was amended."""
        job = await self.jobs.get(gang)
        if job is None:
            return False
        status = job.value.status
        if status.phase not in FINAL:
            return None
        if status.billing is None or status.finished_time is None:
            return False
        epoch = await self.epochs.get(names.epoch_key(gang, status.epoch))
        if epoch is not None and epoch.value.path is not PathClass.RELAYED:
            return False  # a Direct pair's fallback through the relays is not billed
        metered = await relay_bytes(self.bus, gang)
        billed = round(status.billing.mesh_relay_gi_b * 2**30)
        if metered == billed:
            return False
        gib = metered / 2**30

        def amend(current: Job | None) -> Job | None:
            if current is None or current.status.phase not in FINAL:
                return None
            billing = current.status.billing or Billing()
            if billing.mesh_relay_gi_b == gib:
                return None
            billing = msgspec.structs.replace(billing, mesh_relay_gi_b=gib)
            status = msgspec.structs.replace(current.status, billing=billing)
            return msgspec.structs.replace(current, status=status)

        message = (
            f"{metered - billed:+d} relay bytes metered after the bill was made (a relay "
            f"restarted, or its flush waited out the bus): meshRelayGiB is now {gib:.6f}"
        )
        event = JobEvent(
            gang=gang, kind="BillingAmended", epoch=status.epoch, message=message, time=now()
        )
        # The event is stored before the bill changes: a runner killed in between amends the
        # bill on its next sweep and publishes the same event again (one Nats-Msg-Id, stored
        # once). The other way round, a runner killed after the amend lost the event for good:
        # its next sweep found the bill already right (chaos seed 1).
        await self.bus.publish(
            names.job_event(gang, "billingamended"), event, dedup_id=f"{gang}:billing:{metered}"
        )
        if await self.jobs.mutate(gang, amend) is None:
            return False
        log.info("%s: %s", gang, message)
        return True

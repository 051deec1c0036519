"""Writing a job's transitions: a compare-and-set on its record (only while it is still the
epoch and in a phase the transition starts from), then the event that records it. The record
is the truth and the event its audit. The record keeps its last event (`status.lastEvent`,
with a number of its own), and the event's `Nats-Msg-Id` is made from it: a daemon killed
between its write and the event's storage publishes the events of the last
RECENT_EVENT_SECONDS again when it starts, and the stream keeps one of each."""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec

from libs.bus import Bus
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.jobs import Job, JobEvent, JobStatus, LastEvent
from libs.jobs import lifecycle
from libs.jobs.lifecycle import Step, Transition

log = logging.getLogger("nodus.jobs")


async def advance(
    bus: Bus,
    gang: str,
    epoch: int,
    transition: Transition,
    step: Callable[[JobStatus], Step],
) -> Step | None:
    """`step` applied to the job while it is still `epoch` and in one of `transition`'s
    sources; the step written (and its event published), or None: the job moved on."""
    applied: list[Step] = []

    def update(job: Job | None) -> Job | None:
        if job is None or job.status.epoch != epoch or job.status.phase not in transition.sources:
            return None
        result = step(job.status)
        applied[:] = [result]
        return msgspec.structs.replace(job, status=result.status)

    jobs = bus.bucket(names.BUCKET_JOBS, Job)
    if await jobs.mutate(gang, update) is None or not applied:
        return None
    await publish(bus, gang, epoch, applied[0])
    return applied[0]


# Within the stream's de-duplication window (120 s), with room for the daemon's restart.
RECENT_EVENT_SECONDS = 100.0


async def publish(bus: Bus, gang: str, epoch: int, step: Step) -> None:
    if step.event is None:
        return
    await publish_last_event(bus, gang, epoch, step.status)


async def publish_last_event(bus: Bus, gang: str, epoch: int, status: JobStatus) -> None:
    if status.last_event is not None:
        await _publish_event(bus, gang, epoch, status, status.last_event)


def event_message(gang: str, epoch: int, status: JobStatus) -> tuple[str, JobEvent, str] | None:
    """The status's last event as it is published: subject, body and `Nats-Msg-Id` (for a
    writer that sends several at once); None when the status records none."""
    if status.last_event is None:
        return None
    return _event_message(gang, epoch, status, status.last_event)


def _event_message(
    gang: str, epoch: int, status: JobStatus, event: LastEvent
) -> tuple[str, JobEvent, str]:
    body = JobEvent(gang=gang, kind=event.kind, epoch=epoch, message=event.message, time=event.time)
    created = status.created_time.timestamp() if status.created_time else 0.0
    return names.job_event(gang, event.kind.lower()), body, f"{gang}:{created}:{event.seq}"


async def _publish_event(
    bus: Bus, gang: str, epoch: int, status: JobStatus, event: LastEvent
) -> None:
    subject, body, dedup_id = _event_message(gang, epoch, status, event)
    try:
        await bus.publish(subject, body, dedup_id=dedup_id)
    except Exception as error:  # the job record is the truth; the event is its audit
        log.warning("event %s for %s not published: %s", event.kind, gang, error)


async def publish_recent_events(bus: Bus) -> int:
    """At a daemon's start: every event of the last RECENT_EVENT_SECONDS each job keeps (its
    last and the ones before it), published again (the stream drops the ones it has): what
    a daemon killed between its write and the event's storage would otherwise have lost,
    even once the job moved on (chaos seed 1: a placer killed before its Placed event left,
    and the job was Probing when it started again). Best effort; the number published."""
    try:
        jobs = await bus.bucket(names.BUCKET_JOBS, Job).snapshot()
    except Exception as error:  # the records stand; the events are their audit
        log.warning("recent job events not published again: %s", error)
        return 0
    t = now()
    published = 0
    for found in jobs.values():
        status = found.value.status
        kept = status.earlier_events + ([status.last_event] if status.last_event else [])
        for event in kept:
            if (t - event.time).total_seconds() < RECENT_EVENT_SECONDS:
                # Recorded with the event; a record written before it was has 0 there.
                epoch = event.epoch or status.epoch
                await _publish_event(bus, found.key, epoch, status, event)
                published += 1
    return published


async def restart_gang(
    bus: Bus, node: str, gang: str, epoch: int, reason: str, message: str
) -> bool:
    """`gang` goes back to placement without `node` (R16, R17), if `epoch` is still its
    current one and active; True if this call did it. The placer fences the old epoch first,
    then places the next."""
    t = now()
    try:
        step = await advance(
            bus,
            gang,
            epoch,
            lifecycle.MEMBERS_LOST,
            lambda status: lifecycle.members_lost(status, [node], reason, message, t),
        )
    except Exception as error:  # the job moved on; the placer's member checks remain
        log.warning("could not restart %s for %s: %s", gang, node, error)
        return False
    if step is not None:
        log.warning("%s: %s", gang, message)
    return step is not None

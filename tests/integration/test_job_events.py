"""A job's event is not lost with the daemon that wrote the transition (chaos seeds 276742 and
688737 in CI: a runner killed right after it wrote Succeeded, before the event was stored)."""

from __future__ import annotations

import asyncio

import msgspec

from libs.bus import Bus
from libs.bus.kv import Versioned
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.jobs import GangStatus, Job, JobEvent, PathClass
from libs.contracts.placer import PlacerConfig
from libs.jobs import lifecycle
from libs.jobs.store import publish_recent_events
from services.placer.cluster import ClusterView
from services.placer.commit import Committer
from services.placer.jobcache import JobCache
from tests.factories import job


async def test_a_transition_written_whose_event_never_left_is_published_once_at_the_next_start(
    bus: Bus,
) -> None:
    jobs = bus.bucket(names.BUCKET_JOBS, Job)
    admitted = lifecycle.admitted(now(), "placer-0")
    written = msgspec.structs.replace(job("lost-event"), status=admitted.status)
    await jobs.create(written.key, written)  # ... and the daemon was killed here
    assert await bus.replay(names.EVENTS_STREAM, names.job_event(written.key, ">")) == []
    for _ in range(2):  # two daemons start (or one, twice): the stream keeps one
        assert await publish_recent_events(bus) == 1
    stored = await bus.replay(names.EVENTS_STREAM, names.job_event(written.key, ">"))
    assert [m.subject for m in stored] == [names.job_event(written.key, "admitted")]


async def test_events_whose_job_moved_on_before_they_were_stored_are_published_at_the_next_start(
    bus: Bus,
) -> None:
    """A placer killed after it wrote Placed and before the event left; the runner wrote
    Probing meanwhile (chaos seed 1): the next start publishes Placed too, not only the last."""
    jobs = bus.bucket(names.BUCKET_JOBS, Job)
    t = now()
    status = lifecycle.admitted(t, "placer-0").status
    status = lifecycle.placed(
        status, 1, GangStatus(transport=PathClass.RELAYED, members=[]), "placer-0", t
    ).status
    status = lifecycle.probing(status).status
    written = msgspec.structs.replace(job("moved-on"), status=status)
    await jobs.create(written.key, written)  # none of the three events left
    assert await publish_recent_events(bus) == 3
    stored = await bus.replay(names.EVENTS_STREAM, names.job_event(written.key, ">"))
    kinds = [m.subject.rsplit(".", 1)[1] for m in stored]
    assert kinds == ["admitted", "placed", "probing"]
    placed = msgspec.json.decode(stored[1].data, type=JobEvent)
    assert placed.epoch == 1


async def test_a_not_ready_condition_that_lost_its_race_publishes_no_event(
    bus: Bus, placer_config: PlacerConfig
) -> None:
    """A placer replica whose Unschedulable write found the job moved on (another replica
    placed it) published the event anyway; it carried the number of the job's next event, and
    the stream then dropped the real Placed as a duplicate (chaos seed 276742)."""
    jobs = bus.bucket(names.BUCKET_JOBS, Job)
    admitted = lifecycle.admitted(now(), "placer-0")
    written = msgspec.structs.replace(job("raced"), status=admitted.status)
    revision = await jobs.create(written.key, written)
    assert revision is not None
    stale = Versioned(written.key, written, revision)
    placed = lifecycle.placed(
        admitted.status, 1, GangStatus(transport=PathClass.RELAYED, members=[]), "placer-1", now()
    )
    await jobs.update(written.key, msgspec.structs.replace(written, status=placed.status), revision)
    committer = Committer(bus, placer_config, ClusterView(15.0), "placer-0", JobCache())
    await committer.set_gang_ready(stale, "False", "Unschedulable", "no machines")
    await asyncio.gather(*committer.events)  # what it announced has left
    await committer.close()
    assert await bus.replay(names.EVENTS_STREAM, names.job_event(written.key, ">")) == []

"""The placer's view of the cluster (T1): nodes, their heartbeats, and which gang holds each."""

from __future__ import annotations

import asyncio
import heapq
import logging
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta

from libs.bus import Bus
from libs.contracts import names
from libs.contracts.base import now as utc_now
from libs.contracts.epochs import Lease
from libs.contracts.errors import NodusError
from libs.contracts.fleet import NodeHealth, NodeRecord
from libs.contracts.remediation import Cordon
from services.placer.candidates import Candidates


class ClusterView:
    """Kept current from KV watches; `free` indexes every live, healthy, unleased node and
    `registered` every node, for admission's "could it ever run here" question."""

    def __init__(self, heartbeat_timeout: float) -> None:
        self.records: dict[str, NodeRecord] = {}
        self.health: dict[str, NodeHealth] = {}
        self.leases: dict[str, Lease] = {}
        self.cordons: dict[str, Cordon] = {}  # see follow_cordons below
        self.free = Candidates()
        self.registered = Candidates()
        self.inventory_version = 0  # bumps when the set of machines changes
        # Each provider region's class, as its machines say: a relay given a region (not a
        # class) serves that region's class too (services/placer/relays.py).
        self.region_classes: dict[str, str] = {}
        self._timeout = timedelta(seconds=heartbeat_timeout)
        self._newest_beat: datetime | None = None  # the newest heartbeat this view has heard
        # Where the clock stood when heartbeats were heard again after a silence, and when.
        self._clock_at_resume: datetime | None = None
        self._resumed_at: datetime | None = None
        # Every heartbeat heard, oldest first: a sweep looks at the machines whose heartbeat
        # may have aged out since the last, not at the whole fleet (10,000 machines a second
        # was a tenth of the placer's time under a burst of jobs).
        self._beats: list[tuple[datetime, str]] = []

    def set_record(self, node: str, record: NodeRecord | None, now: datetime) -> None:
        if record is None:
            self.records.pop(node, None)
            self.registered.remove(node)
        else:
            self.records[node] = record
            self.registered.add(record)
            self.region_classes[record.inventory.region] = record.inventory.region_class
        self.inventory_version += 1
        self.refresh(node, now)

    def set_health(self, node: str, health: NodeHealth | None, now: datetime) -> None:
        if health is None:
            self.health.pop(node, None)
        else:
            self.health[node] = health
            heapq.heappush(self._beats, (health.heartbeat_time, node))
            if self._newest_beat is not None and now - self._newest_beat > self._timeout / 2:
                self._clock_at_resume = self._clock(now)  # before this beat moves it on
                self._resumed_at = now
            if self._newest_beat is None or health.heartbeat_time > self._newest_beat:
                self._newest_beat = health.heartbeat_time
        self.refresh(node, now)

    def set_lease(self, node: str, lease: Lease | None, now: datetime) -> None:
        if lease is None:
            self.leases.pop(node, None)
        else:
            self.leases[node] = lease
        self.refresh(node, now)

    def alive(self, node: str, now: datetime) -> bool:
        health = self.health.get(node)
        return (
            health is not None
            and health.healthy
            and self._clock(now) - health.heartbeat_time <= self._timeout
        )

    def _clock(self, now: datetime) -> datetime:
        """What heartbeats are judged against: now, unless this view stopped hearing any (its
        watch is behind: a bus server lost, its consumer being made again), then the newest
        heartbeat it heard plus a third of the timeout. A placer whose watch stalled must not
        take every machine for dead (chaos saw six gangs lose every member at once). After
        three timeouts of silence, now again: every agent may really be gone.

        When heartbeats are heard again, the clock goes on from where it stood, at the pace of
        real time, for one timeout: the first agent whose write got through after the bus came
        back must not make the others, still retrying theirs, look dead (chaos seed 477969: a
        gang lost both members after each of three 5-s outages, and its job failed). It is
        never more than one timeout behind."""
        newest = self._newest_beat
        if newest is None or now - newest > 3 * self._timeout:
            return now
        clock = min(now, newest + self._timeout / 3)
        resumed, resumed_at = self._clock_at_resume, self._resumed_at
        if resumed is not None and resumed_at is not None and now - resumed_at < self._timeout:
            clock = min(clock, max(resumed + (now - resumed_at), now - self._timeout))
        return clock

    def refresh(self, node: str, now: datetime) -> bool:
        """Recompute whether `node` is free; True when that changed."""
        record = self.records.get(node)
        free = (
            record is not None
            and node not in self.leases
            and self.alive(node, now)
            and not cordoned(self.cordons, node)
        )
        was = node in self.free
        if free and record is not None:
            if (
                not was
                or self.free.by_shape.get(
                    (record.inventory.accelerators.backend, record.inventory.accelerators.model), {}
                ).get(node)
                is not record
            ):
                self.free.add(record)
        elif was:
            self.free.remove(node)
        return free != was

    def sweep(self, now: datetime) -> bool:
        """Heartbeats age: re-judge the machines whose last heartbeat heard is now older than
        the timeout; True when any stopped being free."""
        changed = False
        expired = self._clock(now) - self._timeout
        while self._beats and self._beats[0][0] < expired:
            beat, node = heapq.heappop(self._beats)
            health = self.health.get(node)
            if health is not None and health.heartbeat_time == beat:  # not heard from since
                changed |= self.refresh(node, now)
        return changed


# -- Cordons (issue 6, automated node repair) ------------------------------------------------------
# A node with any cordon hold (a repair under way, a person's maintenance, a retired machine) is
# never free. The remediator and people write `nodus-cordons`; the placer only reads it.


def cordoned(cordons: Mapping[str, Cordon], node: str) -> bool:
    cordon = cordons.get(node)
    return cordon is not None and bool(cordon.holds)


async def follow_cordons(
    bus: Bus, view: ClusterView, changed: Callable[[], None], caught_up: asyncio.Event
) -> None:
    """Keep `view.cordons` current; a node whose last hold is lifted may be placed on again.
    `caught_up` is set once the current cordons are all in the view."""
    try:
        bucket = bus.bucket(names.BUCKET_CORDONS, Cordon)
    except NodusError as error:
        logging.getLogger("nodus.placer").warning("cordons not followed: %s", error)
        caught_up.set()
        return
    async for change in bucket.watch(caught_up=caught_up):
        if change.value is None:
            view.cordons.pop(change.key, None)
        else:
            view.cordons[change.key] = change.value
        if view.refresh(change.key, utc_now()):
            changed()

"""A placed gang's members, watched: a member that stops heartbeating, is marked unhealthy,
or whose machine booted again since placement ends its gang's epoch (the gang goes back to
placement without it)."""

from __future__ import annotations

import logging

from nats.errors import Error as NatsError

from libs.bus import Bus
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.epochs import Epoch
from libs.contracts.errors import NodusError
from libs.contracts.jobs import Job, JobStatus
from libs.jobs import lifecycle
from libs.jobs.store import advance
from services.placer.cluster import ClusterView

log = logging.getLogger("nodus.placer")


class MemberWatch:
    def __init__(self, bus: Bus, view: ClusterView) -> None:
        self.bus = bus
        self.view = view
        self.jobs = bus.bucket(names.BUCKET_JOBS, Job)
        self.epochs = bus.bucket(names.BUCKET_EPOCHS, Epoch)
        self.active: dict[str, tuple[int, list[str]]] = {}  # placed gangs: epoch, members
        self._boots: dict[str, tuple[int, dict[str, str]]] = {}  # see _placed_boots

    def track(self, key: str, job: Job | None) -> None:
        """Follow a job's record: an active gang's members are watched, any other is not."""
        if job is not None and job.status.phase in lifecycle.ACTIVE and job.status.gang:
            self.active[key] = (job.status.epoch, [m.node for m in job.status.gang.members])
        else:
            self.active.pop(key, None)

    def placed(self, record: Epoch) -> None:
        """An epoch this replica just placed: its members' boots known without a read (a
        burst of placements read each epoch back on the next check, one get per gang)."""
        self._boots[record.gang] = (record.epoch, {m.node: m.boot_id for m in record.members})

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

    async def check(self) -> None:
        """A member that stops heartbeating, is marked unhealthy, or whose machine booted again
        since placement (its agent restarted: ranks and tunnels gone) ends its gang's epoch:
        the gang goes back to placement without it, and its next epoch fences this one first."""
        t = now()
        for key in set(self._boots) - set(self.active):
            del self._boots[key]
        for key, (epoch, members) in list(self.active.items()):
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

            self.active.pop(key, None)
            if await advance(self.bus, key, epoch, lifecycle.MEMBERS_LOST, replace):
                log.warning("%s: %s", key, message)

"""The newest version of each job this replica has seen (its watch, its own writes): a
placement starts from it instead of reading the job again. It may be behind the bus; the
compare-and-set that ends a placement catches that, and the next attempt reads afresh."""

from __future__ import annotations

from libs.bus import Versioned
from libs.contracts.jobs import Job, PathClass, Phase
from libs.contracts.relay import RELAYS_PER_MEMBER
from libs.jobs.lifecycle import ACTIVE


class JobCache:
    def __init__(self) -> None:
        self._jobs: dict[str, Versioned[Job]] = {}

    def saw(self, job: Versioned[Job]) -> None:
        """Keep the newer of what is known and `job` (revisions only grow)."""
        known = self._jobs.get(job.key)
        if known is None or job.revision > known.revision:
            self._jobs[job.key] = job

    def forget(self, key: str) -> None:
        self._jobs.pop(key, None)

    def pending(self, key: str) -> Versioned[Job] | None:
        """The job, if what is known of it says Pending (else the caller reads it: only a
        placement's compare-and-set can tell a stale Pending)."""
        known = self._jobs.get(key)
        return known if known is not None and known.value.status.phase is Phase.PENDING else None

    def relayed_members(self, leaving_out: str = "") -> list[int]:
        """Members of active Relayed gangs homed on each relay slot (but `leaving_out`'s)."""
        counts = [0] * RELAYS_PER_MEMBER
        for key, known in self._jobs.items():
            status = known.value.status
            gang = status.gang
            if (
                key != leaving_out
                and status.phase in ACTIVE
                and gang is not None
                and gang.transport is PathClass.RELAYED
            ):
                for member in gang.members:
                    if member.relay_slot is not None:
                        counts[member.relay_slot % RELAYS_PER_MEMBER] += 1
        return counts

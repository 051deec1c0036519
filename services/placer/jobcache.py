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
        # Members of active Relayed gangs per relay slot, kept as jobs change: a count over
        # every job per Relayed placement made a burst's placements quadratic.
        self._relayed = [0] * RELAYS_PER_MEMBER
        self._slots: dict[str, list[int]] = {}  # an active Relayed gang's members' slots

    def saw(self, job: Versioned[Job]) -> bool:
        """Keep the newer of what is known and `job` (revisions only grow); False when `job`
        is older than what is known (a watch behind this replica's own writes)."""
        known = self._jobs.get(job.key)
        if known is None or job.revision > known.revision:
            self._jobs[job.key] = job
            self._count(job.key, _relay_slots(job.value))
        return known is None or job.revision >= known.revision

    def forget(self, key: str) -> None:
        self._jobs.pop(key, None)
        self._count(key, [])

    def _count(self, key: str, slots: list[int]) -> None:
        for slot in self._slots.pop(key, []):
            self._relayed[slot] -= 1
        if slots:
            self._slots[key] = slots
            for slot in slots:
                self._relayed[slot] += 1

    def pending(self, key: str) -> Versioned[Job] | None:
        """The job, if what is known of it says Pending (else the caller reads it: only a
        placement's compare-and-set can tell a stale Pending)."""
        known = self._jobs.get(key)
        return known if known is not None and known.value.status.phase is Phase.PENDING else None

    def relayed_members(self, leaving_out: str = "") -> list[int]:
        """Members of active Relayed gangs homed on each relay slot (but `leaving_out`'s)."""
        counts = list(self._relayed)
        for slot in self._slots.get(leaving_out, []):
            counts[slot] -= 1
        return counts


def _relay_slots(job: Job) -> list[int]:
    """The relay slot of each member of an active Relayed gang; none for any other job."""
    status = job.status
    gang = status.gang
    if status.phase not in ACTIVE or gang is None or gang.transport is not PathClass.RELAYED:
        return []
    return [m.relay_slot % RELAYS_PER_MEMBER for m in gang.members if m.relay_slot is not None]

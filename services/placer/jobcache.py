"""The newest version of each job this replica has seen (its watch, its own writes): a
placement starts from it instead of reading the job again. It may be behind the bus; the
compare-and-set that ends a placement catches that, and the next attempt reads afresh."""

from __future__ import annotations

from libs.bus import Versioned
from libs.contracts.jobs import Job, Phase


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

"""The newest version of each job this replica has seen (its watch, its own writes): a
placement starts from it instead of reading the job again. It may be behind the bus; the
compare-and-set that ends a placement catches that, and the next attempt reads afresh."""

from __future__ import annotations

from collections import Counter

from libs.bus import Versioned
from libs.contracts.jobs import Job, Phase
from libs.jobs.relays import Home, relay_homes, weighed


class JobCache:
    def __init__(self) -> None:
        self._jobs: dict[str, Versioned[Job]] = {}
        # The load of active Relayed gangs on each relay (their members' shares of the gang's
        # cap), kept as jobs change: a count over every job per Relayed placement made a
        # burst's placements quadratic.
        self._relayed: Counter[Home] = Counter()
        self._loads: dict[str, Counter[Home]] = {}  # an active Relayed gang's load

    def saw(self, job: Versioned[Job]) -> bool:
        """Keep the newer of what is known and `job` (revisions only grow); False when `job`
        is older than what is known (a watch behind this replica's own writes)."""
        known = self._jobs.get(job.key)
        if known is None or job.revision > known.revision:
            self._jobs[job.key] = job
            self._count(job.key, relay_homes(job.value))
        return known is None or job.revision >= known.revision

    def forget(self, key: str) -> None:
        self._jobs.pop(key, None)
        self._count(key, [])

    def _count(self, key: str, homes: list[Home]) -> None:
        known = self._loads.pop(key, None)
        if known:
            self._relayed.subtract(known)
        if homes:  # most jobs are not Relayed: nothing to weigh
            load = weighed(homes)
            self._loads[key] = load
            self._relayed.update(load)

    def pending(self, key: str) -> Versioned[Job] | None:
        """The job, if what is known of it says Pending (else the caller reads it: only a
        placement's compare-and-set can tell a stale Pending)."""
        known = self._jobs.get(key)
        return known if known is not None and known.value.status.phase is Phase.PENDING else None

    def relay_load(self, leaving_out: str = "") -> Counter[Home]:
        """The load of active Relayed gangs on each relay (but `leaving_out`'s), in
        SHARE_UNITS of a gang's cap (libs/jobs/relays.py)."""
        load = Counter(self._relayed)
        load.subtract(self._loads.get(leaving_out, Counter()))
        return load

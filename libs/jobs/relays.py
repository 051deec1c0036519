"""Which relays the active gangs use (pure): where each member of a Relayed gang homes, which
the placer balances on, and what `nodus get relays` shows of each relay."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from datetime import datetime, timedelta

from libs.contracts.jobs import Job, PathClass
from libs.contracts.relay import (
    RELAY_FRESH_SECONDS,
    RELAYS_PER_MEMBER,
    RelayLoad,
    RelayRecord,
)
from libs.jobs.lifecycle import ACTIVE

# Where a member of an active Relayed gang homes: a relay's name, or, for a gang placed
# without named relays (`GangStatus.relays` empty), its slot among the first two live relays
# by name (which relays those are is only known against the live relays of the moment).
Home = str | int


def relay_homes(job: Job) -> list[Home]:
    """Where each member of an active Relayed gang homes; nothing for any other job."""
    status = job.status
    gang = status.gang
    if status.phase not in ACTIVE or gang is None or gang.transport is not PathClass.RELAYED:
        return []
    if gang.relays:
        return [
            gang.relays[m.relay_slot % len(gang.relays)]
            for m in gang.members
            if m.relay_slot is not None
        ]
    return [m.relay_slot % RELAYS_PER_MEMBER for m in gang.members if m.relay_slot is not None]


def is_live(record: RelayRecord, t: datetime) -> bool:
    """Heard from within RELAY_FRESH_SECONDS: members and the placer pick from these."""
    return t - record.heartbeat_time < timedelta(seconds=RELAY_FRESH_SECONDS)


def relay_loads(
    records: Iterable[RelayRecord], jobs: Iterable[Job], t: datetime
) -> list[RelayLoad]:
    """Every relay, by name, with the members homed on it and the gangs naming it. A gang
    placed without named relays counts against the first two live relays by name, as its
    members pick them."""
    relays = sorted(records, key=lambda r: r.name)
    first_two = [r.name for r in relays if is_live(r, t)][:RELAYS_PER_MEMBER]
    members: Counter[str] = Counter()
    gangs: dict[str, list[str]] = {r.name: [] for r in relays}
    for job in jobs:
        homes = relay_homes(job)
        members.update(
            h if isinstance(h, str) else first_two[h] for h in homes if _known(h, first_two)
        )
        gang = job.status.gang
        if job.status.phase not in ACTIVE or gang is None or gang.transport is PathClass.PRIVATE:
            continue
        for name in gang.relays or (first_two if homes else []):
            gangs.setdefault(name, []).append(job.key)
    return [
        RelayLoad(
            name=r.name,
            region=r.region,
            address=r.address,
            version=r.version,
            live=is_live(r, t),
            heartbeat_time=r.heartbeat_time,
            members=members[r.name],
            gangs=sorted(gangs.get(r.name, [])),
        )
        for r in relays
    ]


def _known(home: Home, first_two: list[str]) -> bool:
    return isinstance(home, str) or home < len(first_two)

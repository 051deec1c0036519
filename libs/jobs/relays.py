"""Which relays the active gangs use (pure): where each member of a Relayed gang homes, the
load that puts on each relay, which the placer balances, and what `nodus get relays` shows.

A relay's load is the sum of its homed members' shares of their gang's cap (G18: 1 Gbit/s a
gang, split evenly across its members), not their number: the relay's work is per byte, and a
member of a 2-member gang may send four times what one of an 8-member gang may."""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timedelta
from typing import NamedTuple

from libs.contracts.bounds import RELAY_GANG_BITS_PER_SECOND
from libs.contracts.jobs import MAX_MEMBERS, Job, PathClass
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

# A member's share of its gang's cap in whole units: every gang size divides it, so loads add
# up exactly (ties between relays stay ties).
SHARE_UNITS = 840
assert all(SHARE_UNITS % size == 0 for size in range(1, MAX_MEMBERS + 1))


def member_share(members: int) -> int:
    """One member's share of its gang's cap (G18), in SHARE_UNITS of the gang's whole cap."""
    return SHARE_UNITS // members


def weighed(homes: Sequence[Home]) -> Counter[Home]:
    """The load one gang's members put on each relay: each member's share where it homes."""
    load: Counter[Home] = Counter()
    if homes:
        share = member_share(len(homes))
        for home in homes:
            load[home] += share
    return load


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


class Whereabouts(NamedTuple):
    """Where a member's machine is (its inventory): the provider region and region class."""

    region: str
    region_class: str


NOWHERE = Whereabouts("", "")  # a member that does not say where it is: relays by name


def nearness(relay_region: str, member: Whereabouts, classes: Mapping[str, str]) -> int:
    """2: the relay is in the member's region; 1: in its region class (`classes`: each
    region's class, as the fleet's machines say); 0: elsewhere."""
    if relay_region == member.region:
        return 2
    in_class = member.region_class in (relay_region, classes.get(relay_region))
    return 1 if in_class else 0


def nearest_first(
    records: Iterable[RelayRecord], member: Whereabouts, spread: str | None = None
) -> list[RelayRecord]:
    """Relays nearest `member` first: what a member falls back on without the placer's choice.
    It knows its own region and class, not the fleet's (a relay in another region of its class
    counts as far unless its region is the class). Among equally near relays: by name, as the
    placer counts a gang placed without named relays; or, given `spread` (the gang), in that
    gang's own order, so that the gangs of a relay host that is lost spread evenly over the
    relays left, instead of all landing on the first by name, while one gang's members agree."""
    if spread is None:
        return sorted(records, key=lambda r: (-nearness(r.region, member, {}), r.name))
    return sorted(
        records,
        key=lambda r: (-nearness(r.region, member, {}), _rendezvous(spread, r.name), r.name),
    )


def _rendezvous(gang: str, relay: str) -> bytes:
    """A relay's place in a gang's own order (rendezvous hashing): independent across gangs,
    and a relay added or gone moves only the gangs that would rank it first."""
    return hashlib.blake2b(f"{gang}\0{relay}".encode(), digest_size=8).digest()


_FRESH = timedelta(seconds=RELAY_FRESH_SECONDS)


def is_live(record: RelayRecord, t: datetime) -> bool:
    """Heard from within RELAY_FRESH_SECONDS: members and the placer pick from these."""
    return t - record.heartbeat_time < _FRESH


def relay_loads(
    records: Iterable[RelayRecord], jobs: Iterable[Job], t: datetime
) -> list[RelayLoad]:
    """Every relay, by name, with the members homed on it, their shares of their gangs' caps
    and the gangs naming it. A gang placed without named relays counts against the first two
    live relays by name, as its members pick them."""
    relays = sorted(records, key=lambda r: r.name)
    first_two = [r.name for r in relays if is_live(r, t)][:RELAYS_PER_MEMBER]
    members: Counter[str] = Counter()
    load: Counter[str] = Counter()
    gangs: dict[str, list[str]] = {r.name: [] for r in relays}
    for job in jobs:
        homes = relay_homes(job)
        for home in homes:
            if _known(home, first_two):
                name = home if isinstance(home, str) else first_two[home]
                members[name] += 1
                load[name] += member_share(len(homes))
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
            shared_address=r.shared_address,
            heartbeat_time=r.heartbeat_time,
            members=members[r.name],
            cap_mbps=load[r.name] * RELAY_GANG_BITS_PER_SECOND // SHARE_UNITS // 1_000_000,
            gangs=sorted(gangs.get(r.name, [])),
        )
        for r in relays
    ]


def _known(home: Home, first_two: list[str]) -> bool:
    return isinstance(home, str) or home < len(first_two)

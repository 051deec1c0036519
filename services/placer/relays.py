"""Which two relays a Relayed gang uses (G15), and on which of them each member homes (sans-I/O).

A gang gets relays of its members' region: a relay whose `--region` is a member's region
(`us-east-1`) is nearest, one of the member's region class next (its region is the class, `us`,
or a region whose machines are of that class), any other last. Among those equally near, the
least loaded of every live relay (its load: the shares of their gangs' caps of the members
homed on it, over the active gangs, libs/jobs/relays.py), so adding relays adds capacity: one
relay process per core of a relay host, or more hosts, or more regions. A gang spanning
regions gets the relay nearest most of its members and the one that brings the rest nearest,
each member homed on the nearer of the two. Members equally near both spread evenly over
them; each fails over to the other. While only one relay is live, a gang gets it and the
relay heard from last, its members all homed on the live one, so that it has a failover once
the other is back. A gang whose agents, or a live relay, predate named relays gets none
(`RelayChoice.relays` empty): its members use the first two live relays by name, as before,
and the counts still see them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from operator import mul

from libs.contracts.relay import (
    CAPABILITY_EPOCH_RELAYS,
    RELAYS_PER_MEMBER,
    RelayRecord,
)
from libs.jobs.relays import Home, Whereabouts, is_live, member_share, nearness

PAIR = RELAYS_PER_MEMBER  # relays per gang (G15): a member's home and its failover
# A relay silent for less than this may be the failover of a gang placed while it is down
# (a restart, a maintenance): it is likely to come back.
SILENT_PARTNER = timedelta(minutes=10)


@dataclass(frozen=True, slots=True)
class RelayChoice:
    relays: list[str]  # the gang's two relays by name; empty: the first two live by name
    slots: list[int]  # each member's home, in rank order: an index into the two
    homes: list[Home]  # what the choice adds to each relay's count


class LiveRelays:
    """The relays' own records (their heartbeats), as the relays bucket's watch says."""

    def __init__(self) -> None:
        self.records: dict[str, RelayRecord] = {}

    def set(self, name: str, record: RelayRecord | None) -> None:
        if record is None:
            self.records.pop(name, None)
        else:
            self.records[name] = record

    def live(self, t: datetime) -> list[RelayRecord]:
        """The relays whose heartbeat is fresh, by name (what an agent picks from, too)."""
        return sorted(
            (r for r in self.records.values() if is_live(r, t)),
            key=lambda r: r.name,
        )

    def choose(
        self,
        members: Sequence[Whereabouts],
        load: Counter[Home],
        named: bool,
        t: datetime,
        home: bool = True,
        classes: Mapping[str, str] | None = None,
    ) -> RelayChoice:
        """The gang's relays and, if `home`, its members' homes (in rank order), given the
        load already on each relay (`load`, in SHARE_UNITS: by name, or by slot for gangs
        without named relays). `named`: the gang's agents read named relays; every live relay must,
        too. A Direct gang's pair (`home` False) is only its fallback and homes no one.
        `classes`: each provider region's class, as the fleet's machines say."""
        live = self.live(t)
        by_name = [r.name for r in live]
        first_two = by_name[:PAIR]

        def load_of(name: str) -> int:
            legacy = first_two.index(name) if name in first_two else None
            return load[name] + (load[legacy] if legacy is not None else 0)

        named = (
            named
            and len(live) >= 1
            and all(CAPABILITY_EPOCH_RELAYS in r.capabilities for r in live)
        )
        silent = self._last_heard_other(live, t) if named and len(live) == 1 else None
        homed = list(members) if home else []
        if named and silent is not None:
            # One relay is live, the other down (restarting, or in maintenance): the gang
            # still gets two, every member homed on the live one. Its tunnels keep dialling
            # the other and fail over to it once it is back; a gang given only the live relay
            # had no failover for its whole life (G15).
            pair = sorted([by_name[0], silent])
            slots = [pair.index(by_name[0])] * len(homed)
            return RelayChoice(pair, slots, [pair[s] for s in slots])
        # How near each relay is to each place the gang's members are in (a gang is in one or
        # a few places: this is per place, not per member), and its load, worked out once.
        places: dict[Whereabouts, int] = {}
        for member in members:
            places[member] = places.get(member, 0) + 1
        weights = list(places.values())
        known = classes or {}
        near = {r.name: [nearness(r.region, w, known) for w in places] for r in live}
        if named and len(live) >= PAIR:
            # The relay nearest most members, then the one that brings the rest nearest;
            # among relays equally near, the least loaded (ties by name).
            loads = {n: load_of(n) for n in by_name}
            total = {n: sum(map(mul, v, weights)) for n, v in near.items()}
            ranked = sorted(by_name, key=lambda n: (-total[n], loads[n], n))
            first = ranked[0]
            # The failover on another host than the home relay when one is as near: one
            # host's relays (one per core, sharing its 443) go down together with it.
            first_host = _host(self.records[first].address)

            def beside_first(name: str) -> bool:
                return _host(self.records[name].address) == first_host

            second = min(ranked[1:], key=lambda n: (-total[n], beside_first(n), loads[n], n))
            if len(places) > 1:  # in one place, the nearest leaves nobody nearer elsewhere
                nearest_first = near[first]

                def gained(name: str) -> int:
                    pairs = zip(near[name], nearest_first, weights, strict=True)
                    return sum(max(0, a - b) * k for a, b, k in pairs)

                second = min(
                    ranked[1:],
                    key=lambda n: (-gained(n), -total[n], beside_first(n), loads[n], n),
                )
            pair = sorted([first, second])
            counts = [loads[n] for n in pair]
        else:
            pair = []
            counts = [load_of(first_two[i]) if i < len(first_two) else load[i] for i in range(PAIR)]
        slots = []
        spots = {w: i for i, w in enumerate(places)}
        share = member_share(len(homed)) if homed else 0
        for member in homed:
            # The nearer of the two; equally near, the less loaded (ties: the first).
            candidates: Sequence[int] = range(PAIR)
            if pair:
                spot = spots[member]
                nearest = max(near[n][spot] for n in pair)
                candidates = [s for s in range(PAIR) if near[pair[s]][spot] == nearest]
            slot = min(candidates, key=lambda s: counts[s])
            counts[slot] += share
            slots.append(slot)
        homes: list[Home] = [pair[s] for s in slots] if pair else list(slots)
        return RelayChoice(pair, slots, homes)

    def near_no_machine(self, classes: Mapping[str, str], t: datetime) -> list[RelayRecord]:
        """Live relays whose region is neither a region nor a region class of any registered
        machine (`classes`: region -> class): near nobody, so used only when nothing nearer
        is, most likely a mistyped `--region`."""
        known = set(classes) | set(classes.values())
        return [r for r in self.live(t) if r.region not in known] if classes else []

    def _last_heard_other(self, live: list[RelayRecord], t: datetime) -> str | None:
        """The relay not live whose last heartbeat is the newest, if it was heard within
        SILENT_PARTNER (a relay retired long ago is not dialled for nothing) and
        reads named relays; else None."""
        live_names = {r.name for r in live}
        others = [
            r
            for r in self.records.values()
            if r.name not in live_names
            and t - r.heartbeat_time < SILENT_PARTNER
            and CAPABILITY_EPOCH_RELAYS in r.capabilities
        ]
        return max(others, key=lambda r: r.heartbeat_time).name if others else None


def _host(address: str) -> str:
    """The host of a relay's host:port (its advertised address)."""
    return address.rpartition(":")[0].strip("[]")

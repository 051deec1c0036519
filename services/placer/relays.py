"""Which two relays a Relayed gang uses (G15), and on which of them each member homes (sans-I/O).

A gang gets the two least loaded of every live relay (members homed, counted over the active
gangs), so adding relays adds capacity: one relay process per core of a relay host, or more
hosts. Its members spread evenly over the two; each fails over to the other. While only one
relay is live, a gang gets it and the relay heard from last, its members all homed on the live
one, so that it has a failover once the other is back. A gang whose agents, or a live relay,
predate named relays gets none (`RelayChoice.relays` empty): its members use the first two
live relays by name, as before, and the counts still see them."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timedelta

from libs.contracts.relay import (
    CAPABILITY_EPOCH_RELAYS,
    RELAY_FRESH_SECONDS,
    RELAYS_PER_MEMBER,
    RelayRecord,
)
from services.placer.jobcache import Home

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

    def __init__(self, fresh_seconds: float = RELAY_FRESH_SECONDS) -> None:
        self.records: dict[str, RelayRecord] = {}
        self._fresh = timedelta(seconds=fresh_seconds)

    def set(self, name: str, record: RelayRecord | None) -> None:
        if record is None:
            self.records.pop(name, None)
        else:
            self.records[name] = record

    def live(self, t: datetime) -> list[RelayRecord]:
        """The relays whose heartbeat is fresh, by name (what an agent picks from, too)."""
        return sorted(
            (r for r in self.records.values() if t - r.heartbeat_time < self._fresh),
            key=lambda r: r.name,
        )

    def choose(self, members: int, load: Counter[Home], named: bool, t: datetime) -> RelayChoice:
        """The gang's relays and its members' homes, given the members already homed on each
        relay (`load`: by name, or by slot for gangs without named relays). `named`: the
        gang's agents read named relays; every live relay must, too."""
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
        if named and silent is not None:
            # One relay is live, the other down (restarting, or in maintenance): the gang
            # still gets two, every member homed on the live one. Its tunnels keep dialling
            # the other and fail over to it once it is back; a gang given only the live relay
            # had no failover for its whole life (G15).
            pair = sorted([by_name[0], silent])
            counts = [0 if n == by_name[0] else members + 1 for n in pair]
        elif named and len(live) >= PAIR:
            pair = sorted(sorted(by_name, key=lambda n: (load_of(n), n))[:PAIR])
            counts = [load_of(n) for n in pair]
        else:
            pair = []
            counts = [load_of(first_two[i]) if i < len(first_two) else load[i] for i in range(PAIR)]
        slots = []
        for _ in range(members):
            slot = counts.index(min(counts))  # ties go to the first
            counts[slot] += 1
            slots.append(slot)
        homes: list[Home] = [pair[s] for s in slots] if pair else list(slots)
        return RelayChoice(pair, slots, homes)

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

"""Qualification runs (G21): what `nodus qualify` measured on machines of one pair of types, one
path, with a gang of 2 members (or N on the Relayed path: issue 26). The placer places a path
on the combinations measured here, beside its config's overrides."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime

from libs.contracts.base import Record
from libs.contracts.jobs import PathClass


def machine_type(provider: str, offering: str) -> str:
    return f"{provider}/{offering}"


def pair_of(a: str, b: str) -> str:
    """The pair of two machine types, in one order: `provider/offering+provider/offering`."""
    return "+".join(sorted((a, b)))


class Qualification(Record):
    path: PathClass
    pair: str  # pair_of(...) of the machine types it ran on
    machines: list[str]
    ok: bool  # the probe qualified every pair and the all-reduce verified on every rank
    tcp_gbps: float  # the slowest pair's
    rtt_ms: float
    allreduce_bus_gbps: float | None  # the example all-reduce's bus bandwidth, slowest rank
    job: str
    measured_time: datetime
    reason: str = ""  # why it is not ok
    members: int = 2  # the gang it measured: a Relayed gang of up to this many is qualified


def qualification_key(path: PathClass, pair: str, members: int = 2) -> str:
    a, b = pair.split("+", 1)
    key = f"{path.value}.{a}.{b}"
    return key if members == 2 else f"{key}.m{members}"


def covered_pairs(pair: str, members: int) -> list[str]:
    """The pairs of machine types a run on `pair` put side by side: a gang of 3 or more on two
    types has members of one type together too."""
    a, b = pair.split("+", 1)
    if members <= 2 or a == b:
        return [pair]
    return [pair, pair_of(a, a), pair_of(b, b)]


def qualified_pairs(records: Iterable[Qualification]) -> dict[PathClass, dict[str, int]]:
    """Per path, each pair measured with success and the largest gang it was measured in."""
    qualified: dict[PathClass, dict[str, int]] = {}
    for record in records:
        if not record.ok:
            continue
        pairs = qualified.setdefault(record.path, {})
        for pair in covered_pairs(record.pair, record.members):
            pairs[pair] = max(pairs.get(pair, 0), record.members)
    return qualified

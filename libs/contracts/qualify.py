"""Qualification runs (G21): what `nodus qualify` measured on one pair of machines, one path.
The placer places a path on the combinations measured here, beside its config's overrides."""

from __future__ import annotations

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
    pair: str  # pair_of(...) of the machines it ran on
    machines: list[str]
    ok: bool  # the probe qualified the pair and the all-reduce verified on both ranks
    tcp_gbps: float
    rtt_ms: float
    allreduce_bus_gbps: float | None  # the example all-reduce's bus bandwidth, slowest rank
    job: str
    measured_time: datetime
    reason: str = ""  # why it is not ok


def qualification_key(path: PathClass, pair: str) -> str:
    a, b = pair.split("+", 1)
    return f"{path.value}.{a}.{b}"

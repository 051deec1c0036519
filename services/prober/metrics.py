"""The prober's per-gang gauges, and their end: a gang's series go when its run ends, so a
long-lived prober does not keep one series per gang and pair it ever probed."""

from __future__ import annotations

from prometheus_client import Gauge

from libs.contracts.lifecycle import PairResult

PAIR_GBPS = Gauge(
    "nodus_prober_pair_tcp_gbps",
    "TCP throughput the last qualified probe measured, per pair (Gbit/s)",
    ["gang", "a", "b", "path"],
)
PAIR_RTT = Gauge(
    "nodus_prober_pair_rtt_seconds",
    "Round-trip time the last qualified probe measured, per pair",
    ["gang", "a", "b", "path"],
)
JOBS = Gauge("nodus_prober_jobs", "Jobs by phase, as the gang's run sees them", ["phase"])
DEGRADED = Gauge(
    "nodus_prober_network_degraded",
    "1 while some pair of a running gang goes through the relays (NetworkDegraded)",
    ["gang"],
)

_pairs: dict[str, list[tuple[str, str, str, str]]] = {}  # gang -> the pair series it has


def record_pairs(gang: str, results: list[PairResult]) -> None:
    """A qualified probe's figures for every pair; an earlier epoch's go."""
    forget_pairs(gang)
    _pairs[gang] = []
    for result in results:
        labels = (gang, result.a, result.b, result.path)
        PAIR_GBPS.labels(*labels).set(result.tcp_gbps)
        PAIR_RTT.labels(*labels).set(result.rtt_ms / 1000)
        _pairs[gang].append(labels)


def forget_pairs(gang: str) -> None:
    for labels in _pairs.pop(gang, []):
        for gauge in (PAIR_GBPS, PAIR_RTT):
            try:
                gauge.remove(*labels)
            except KeyError:
                pass


def forget_gang(gang: str) -> None:
    """The run ended: its series go."""
    forget_pairs(gang)
    try:
        DEGRADED.remove(gang)
    except KeyError:
        pass

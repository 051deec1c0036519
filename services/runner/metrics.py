"""The runner's metrics. Its per-gang gauges end with the gang: a gang's series go when its
run ends, so a long-lived runner does not keep one series per gang and pair it ever probed.
Until the next release they are also exported under the prober's old names (`nodus_prober_*`),
so an operator's own dashboards and alerts keep working while they move."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

from libs.contracts.lifecycle import PairResult

PAIR_GBPS = Gauge(
    "nodus_runner_pair_tcp_gbps",
    "TCP throughput the last qualified probe measured, per pair (Gbit/s)",
    ["gang", "a", "b", "path"],
)
PAIR_RTT = Gauge(
    "nodus_runner_pair_rtt_seconds",
    "Round-trip time the last qualified probe measured, per pair",
    ["gang", "a", "b", "path"],
)
JOBS = Gauge("nodus_runner_jobs", "Jobs by phase, as the gang's run sees them", ["phase"])
DEGRADED = Gauge(
    "nodus_runner_network_degraded",
    "1 while some pair of a running gang goes through the relays (NetworkDegraded)",
    ["gang"],
)

PROBES = Counter("nodus_runner_probes_total", "Epoch probes by outcome", ["outcome"])
PROBE_SECONDS = Histogram(
    "nodus_runner_probe_seconds",
    "Wall time of one epoch's probe",
    buckets=(1, 2, 5, 10, 20, 40, 80, 160, 320),
)
TAKEOVERS = Counter(
    "nodus_runner_takeovers_total",
    "Epoch probes taken over from a runner replica that went silent or restarted",
)
RUNS = Counter("nodus_runner_runs_total", "Gang runs by outcome", ["outcome"])

NAME = "nodus_runner_"
OLD_NAME = "nodus_prober_"  # until the next release

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


class _OldNames:
    """Every runner metric again under its old name, from the same values."""

    def describe(self) -> list[Metric]:
        return []  # nothing collected at registration

    def collect(self) -> Iterator[Metric]:
        for metric in (PAIR_GBPS, PAIR_RTT, JOBS, DEGRADED, PROBES, PROBE_SECONDS, TAKEOVERS, RUNS):
            for family in metric.collect():
                old = Metric(
                    family.name.replace(NAME, OLD_NAME, 1),
                    f"{family.documentation} (deprecated name of {family.name})",
                    family.type,
                    family.unit,
                )
                old.samples = [
                    sample._replace(name=sample.name.replace(NAME, OLD_NAME, 1))
                    for sample in family.samples
                ]
                yield old


_exported = False


def export_old_names() -> None:
    """Once per process, by the daemon (tests that import the runner do not)."""
    global _exported
    if not _exported:
        REGISTRY.register(_OldNames())
        _exported = True

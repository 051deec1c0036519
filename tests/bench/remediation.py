"""Node repair benchmark: decision latency from a signal to its recommendation, and alerts
handled per second, on a generated fleet, against the bus round trip of the same run.

    .venv/bin/python -m tests.bench.remediation            # 10,000 nodes
    .venv/bin/python -m tests.bench.remediation --quick    # 1,000 nodes (smoke)

What runs: a real nats-server with JetStream; the remediator as its own process
(`python -m app remediator`, the daemon users run) with a persistence window of 0, so a
signal becomes a recommendation as soon as it is decided; this process as the fleet's detectors.
The fleet is registered the way agents do it (NodeRecord + NodeHealth) before the remediator
starts. Default policy (approve before repair): every recommendation also becomes a Pending
remediation, and nothing is repaired, so the figures are the decisions alone.

1. baseline, the remediator idle: the request/reply round trip to an echo responder on another
   connection, and a KV put observed by a watch on another connection (the hop a signal takes
   to reach the remediator; a decision is at least two such hops: the signal in, the
   recommendation out);
2. decision latency: one node at a time, a `SignalReport` (a ReadonlyFilesystem finding from
   NPD) is put to `nodus-signals`; the time until a watch on `nodus-recommendations` sees its
   recommendation;
3. burst: every other node reports at once; alerts, recommendations and remediations written
   per second, from the first put to the last record seen by watches.

Speed is reported, never asserted: stdout carries one JSON object, progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import nats.errors

from libs.bus import Bus
from libs.bus.kv import Bucket
from libs.bus.server import NatsServer, free_port
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.fleet import NodeHealth, NodeRecord
from libs.contracts.remediation import (
    Alert,
    Recommendation,
    Remediation,
    SignalReport,
)
from tests.factories import machine, node_record
from tests.remediation_support import readonly_report

REPO = Path(__file__).resolve().parents[2]


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def quantiles(samples: list[float]) -> dict[str, float]:
    if not samples:
        return {}
    ordered = sorted(samples)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {
        "n": len(ordered),
        "mean_ms": round(statistics.fmean(ordered) * 1e3, 3),
        "p50_ms": round(at(0.5) * 1e3, 3),
        "p90_ms": round(at(0.9) * 1e3, 3),
        "p99_ms": round(at(0.99) * 1e3, 3),
        "max_ms": round(ordered[-1] * 1e3, 3),
    }


def scrape(port: int) -> dict[str, float]:
    """The remediator's own figures from its /metrics."""
    from services.monitor.detectors import prom

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    wanted = {}
    for sample in prom.parse(text).samples:
        if sample.name.startswith("nodus_remediator_") and not sample.labels.get("le"):
            key = sample.name + "".join(f"{{{k}={v}}}" for k, v in sorted(sample.labels.items()))
            wanted[key] = sample.value
    return wanted


async def scrape_after(port: int, before: dict[str, float], decisions: int) -> dict[str, float]:
    """The counters once `decisions` more were counted (or after 5 s): the remediator observes
    a decision's time after its write is acknowledged, which may come after a watch saw it."""
    deadline = time.perf_counter() + 5.0
    while True:
        after = scrape(port)
        if internal(before, after)["decisions"] >= decisions or time.perf_counter() > deadline:
            return after
        await asyncio.sleep(0.05)


def internal(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    count = after.get("nodus_remediator_decision_seconds_count", 0) - before.get(
        "nodus_remediator_decision_seconds_count", 0
    )
    total = after.get("nodus_remediator_decision_seconds_sum", 0) - before.get(
        "nodus_remediator_decision_seconds_sum", 0
    )
    return {
        "decisions": int(count),
        "mean_ms_report_received_to_recommendation_written": (
            round(total / count * 1e3, 3) if count else None
        ),
    }


class Arrivals:
    """First time a watch saw each key of a bucket."""

    def __init__(self, bucket: Bucket[Any]) -> None:
        self.first: dict[str, float] = {}
        self.changed = asyncio.Event()
        self._bucket = bucket
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        caught_up = asyncio.Event()
        self.task = asyncio.create_task(self._run(caught_up))
        await caught_up.wait()

    async def _run(self, caught_up: asyncio.Event) -> None:
        async for change in self._bucket.watch(caught_up=caught_up):
            if change.value is not None and change.key not in self.first:
                self.first[change.key] = time.perf_counter()
                self.changed.set()

    async def wait_for(self, key: str, timeout: float) -> float:
        deadline = time.perf_counter() + timeout
        while key not in self.first:
            self.changed.clear()
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                raise TimeoutError(key)
            try:
                await asyncio.wait_for(self.changed.wait(), remaining)
            except TimeoutError:
                pass
        return self.first[key]

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            try:
                await self.task
            except (asyncio.CancelledError, Exception):
                pass


async def register(bus: Bus, nodes: int, per_cluster: int) -> float:
    started = time.perf_counter()
    records = bus.bucket(names.BUCKET_NODES, NodeRecord)
    health = bus.bucket(names.BUCKET_HEALTH, NodeHealth)
    chunk = 500
    for start in range(0, nodes, chunk):
        batch = []
        for i in range(start, min(nodes, start + chunk)):
            name = f"n{i:05d}"
            record = node_record(
                machine(
                    name,
                    pool=f"pool-{i // 8}",
                    cluster=f"c{i // per_cluster}",
                    address=f"10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}",
                )
            )
            batch.append(records.put(name, record))
            batch.append(
                health.put(
                    name, NodeHealth(node=name, healthy=True, heartbeat_time=now(), boot_id="b0")
                )
            )
        await asyncio.gather(*batch)
    return time.perf_counter() - started


async def baseline(url: str, samples: int) -> dict[str, Any]:
    a = await Bus.open(url, name="bench-a", buckets=[names.BUCKET_SIGNALS])
    b = await Bus.open(url, name="bench-b", buckets=[names.BUCKET_SIGNALS])
    try:

        async def echo(msg: Any) -> None:
            await msg.respond(msg.data)

        await b.nc.subscribe("bench.echo", cb=echo)
        await b.nc.flush()
        for _ in range(40):  # the other connection's interest can take a moment to be seen
            try:
                await a.nc.request("bench.echo", b"x", timeout=5)
                break
            except nats.errors.NoRespondersError:
                await asyncio.sleep(0.05)
        rtt = []
        for _ in range(samples):
            t0 = time.perf_counter()
            await a.nc.request("bench.echo", b"x" * 200, timeout=5)
            rtt.append(time.perf_counter() - t0)
        bucket_a = a.bucket(names.BUCKET_SIGNALS, SignalReport)
        seen = Arrivals(b.bucket(names.BUCKET_SIGNALS, SignalReport))
        await seen.start()
        hop = []
        for i in range(samples):
            key = f"baseline-{i}.npd"
            t0 = time.perf_counter()
            await bucket_a.put(key, readonly_report(f"baseline-{i}"))
            hop.append(await seen.wait_for(key, 10) - t0)
        await seen.stop()
        for i in range(samples):
            await bucket_a.delete(f"baseline-{i}.npd")
        return {"request_reply_rtt": quantiles(rtt), "kv_put_to_watch": quantiles(hop)}
    finally:
        await a.close()
        await b.close()


def spawn_remediator(
    url: str, state: Path, metrics_port: int, profile: str | None = None
) -> subprocess.Popen[bytes]:
    env = {**os.environ, "NODUS_NATS_URL": url, "NODUS_LOG_FORMAT": "json"}
    logfile = open(state / "remediator.log", "wb")
    return subprocess.Popen(
        [
            sys.executable,
            *(("-m", "cProfile", "-o", profile) if profile else ()),
            "-m",
            "app",
            "remediator",
            "--replica",
            "bench",
            "--state-dir",
            str(state),
            "--persistence-seconds",
            "0",
            "--metrics-port",
            str(metrics_port),
            "--log-level",
            "WARNING",
        ],
        stdout=logfile,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=REPO,
        start_new_session=True,
    )


async def wait_ready(bus: Bus, timeout: float) -> float:
    """Until the remediator answers NATS service discovery (its watches have replayed)."""
    started = time.perf_counter()
    deadline = started + timeout
    while time.perf_counter() < deadline:
        try:
            await bus.nc.request("$SRV.PING.nodus-remediator", b"", timeout=0.5)
            return time.perf_counter() - started
        except Exception:  # no responders yet, or a timeout
            await asyncio.sleep(0.05)
    raise TimeoutError("the remediator did not answer $SRV.PING")


async def run(opts: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {
        "params": {"nodes": opts.nodes, "samples": opts.samples, "per_cluster": opts.per_cluster},
        "host": {"python": platform.python_version(), "cpus": os.cpu_count()},
    }
    with tempfile.TemporaryDirectory(prefix="nodus-bench-remediation-") as tmp:
        state = Path(tmp)
        server = NatsServer(state / "nats").start()
        # Authentication is on: this bench and the processes it starts are the bus's operator.
        os.environ["NODUS_CREDENTIALS"] = server.credentials or ""
        process: subprocess.Popen[bytes] | None = None
        bus = await Bus.open(
            server.url,
            name="bench",
            buckets=[*names.ALL_BUCKETS, *names.REMEDIATION_BUCKETS],
            streams=True,
        )
        try:
            log(f"registering {opts.nodes} nodes")
            result["fleet"] = {
                "nodes": opts.nodes,
                "clusters": -(-opts.nodes // opts.per_cluster),
                "register_s": round(await register(bus, opts.nodes, opts.per_cluster), 3),
            }
            log("baseline")
            result["baseline"] = await baseline(server.url, opts.baseline_samples)
            metrics_port = free_port()
            process = spawn_remediator(server.url, state, metrics_port, opts.profile)
            ready = await wait_ready(bus, opts.timeout)
            result["remediator_start_s"] = round(ready, 3)
            alerts = Arrivals(bus.bucket(names.BUCKET_ALERTS, Alert))
            recs = Arrivals(bus.bucket(names.BUCKET_RECOMMENDATIONS, Recommendation))
            rems = Arrivals(bus.bucket(names.BUCKET_REMEDIATIONS, Remediation))
            for arrivals in (alerts, recs, rems):
                await arrivals.start()
            signals = bus.bucket(names.BUCKET_SIGNALS, SignalReport)
            nodes = [f"n{i:05d}" for i in range(opts.nodes)]
            log(f"decision latency, {opts.samples} signals one at a time")
            before = scrape(metrics_port)
            latencies = []
            for node in nodes[: opts.samples]:
                t0 = time.perf_counter()
                await signals.put(names.signal_key(node, "npd"), readonly_report(node))
                seen = await recs.wait_for(f"{node}.readonly-filesystem.root", opts.timeout)
                latencies.append(seen - t0)
            result["decision_latency"] = quantiles(latencies)
            serial = await scrape_after(metrics_port, before, opts.samples)
            result["decision_latency"]["remediator_internal"] = internal(before, serial)
            burst = nodes[opts.samples :]
            log(f"burst: {len(burst)} nodes report at once")
            t0 = time.perf_counter()
            for start in range(0, len(burst), 1000):
                await asyncio.gather(
                    *(
                        signals.put(names.signal_key(n, "npd"), readonly_report(n))
                        for n in burst[start : start + 1000]
                    )
                )
            put_done = time.perf_counter() - t0
            deadline = time.perf_counter() + opts.timeout
            wanted = len(nodes)
            for arrivals in (alerts, recs, rems):
                while len(arrivals.first) < wanted and time.perf_counter() < deadline:
                    arrivals.changed.clear()
                    try:
                        await asyncio.wait_for(arrivals.changed.wait(), 1.0)
                    except TimeoutError:
                        continue

            in_burst = set(burst)

            def rate(arrivals: Arrivals) -> dict[str, Any]:
                times = [t for key, t in arrivals.first.items() if key.split(".")[0] in in_burst]
                if not times:
                    return {"count": 0}
                span = max(times) - t0
                return {
                    "count": len(times),
                    "last_after_s": round(span, 3),
                    "per_second": round(len(times) / span, 1) if span > 0 else None,
                }

            result["burst"] = {
                "nodes": len(burst),
                "puts_done_s": round(put_done, 3),
                "alerts": rate(alerts),
                "recommendations": rate(recs),
                "remediations_pending": rate(rems),
                "complete": len(alerts.first) >= wanted and len(recs.first) >= wanted,
            }
            for arrivals in (alerts, recs, rems):
                await arrivals.stop()
            after = await scrape_after(metrics_port, serial, len(burst))
            result["burst"]["remediator_internal"] = internal(serial, after)
            result["remediator_counters"] = {
                k.removeprefix("nodus_remediator_"): v
                for k, v in after.items()
                if k.endswith("_total") or "_total{" in k
            }
            base = result["baseline"]
            hop = base["kv_put_to_watch"]["p50_ms"]
            rtt = base["request_reply_rtt"]["p50_ms"]
            decision = result["decision_latency"]["p50_ms"]
            alerts_rate = result["burst"]["alerts"].get("per_second")
            result["ratios"] = {
                "decision_p50_over_kv_hop_p50": round(decision / hop, 2) if hop else None,
                "decision_p50_over_request_rtt_p50": round(decision / rtt, 2) if rtt else None,
                "alerts_per_second_x_request_rtt": (
                    round(alerts_rate * rtt / 1e3, 2) if alerts_rate and rtt else None
                ),
            }
        finally:
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    process.kill()
            await bus.close()
            server.stop()
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--samples", type=int, default=200, help="serial decision samples")
    parser.add_argument("--baseline-samples", type=int, default=300)
    parser.add_argument("--per-cluster", type=int, default=1000, help="nodes per cluster")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--quick", action="store_true", help="1,000 nodes, 50 samples")
    parser.add_argument("--profile", help="run the remediator under cProfile, into this file")
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.nodes, opts.samples, opts.baseline_samples = 1000, 50, 100
    return opts


def main() -> int:
    result = asyncio.run(run(parse_args()))
    print(json.dumps(result, indent=2))
    return 0 if result.get("burst", {}).get("complete") else 1


if __name__ == "__main__":
    sys.exit(main())

"""Placement benchmark: a generated fleet, a burst of jobs, time from apply to `Placed`.

    .venv/bin/python -m tests.bench.placement            # 10,000 machines, 1,000 jobs
    .venv/bin/python -m tests.bench.placement --quick    # 1,000 machines, 100 jobs (smoke)

What runs: a real nats-server with JetStream; the placer as its own process
(`python -m app placer`, the daemon users run); this process as the load generator.
The generated fleet is registered the way agents do it (a NodeRecord in `nodus-nodes`, a
NodeHealth in `nodus-health`) before the placer starts, so the placer's start measures the
load of the whole view. Then every job is applied at once (several client connections) while
a watch on `nodus-jobs` timestamps the first record of each job that says `Placed`.

The baseline is measured in the same run, on the same server, while the placer is idle: the
request/reply round trip to a trivial echo responder in its own process (one at a time, and
as a burst shaped like the apply burst), and a KV put and get round trip. Ratios relate the
placement figures to it. Speed is reported, never asserted; stdout carries one JSON object,
progress goes to stderr. Exit status 1 means the run did not complete (timeout, undecided
jobs), not that it was slow.

The JSON, by section:
  fleet, jobs        what was generated; registration time; this process's own snapshot of
                     nodes + health (the read the placer does at start)
  planner_only       the placer's Planner over the same fleet and jobs in this process, no bus:
                     the CPU floor of the decisions
  placer_start       spawn -> answers $SRV.PING (snapshot loaded); -> its watches have replayed
                     the fleet (a sentinel job is admitted, then placed)
  baseline           NATS request/reply RTT (serial and burst), KV put/get RTT, placer idle
  placement          decisions/s, apply -> Placed p50/p99 (watch-observed and as recorded in
                     status.placedTime), apply reply latency, counts, rates while applies are
                     still being answered and after
  placer_internal    the placer's own Prometheus counters over the burst (mean time in _place)
  cpu_s_during_burst CPU seconds of the placer, nats-server and this process during the burst
  ratios             the placement figures over the baseline

`--profile-placer FILE` runs the placer under cProfile (slower; for finding where time goes).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import nats
import yaml
from nats.js.api import KeyValueConfig, StorageType

import libs
from libs.bus import Bus
from libs.bus.server import NatsServer, free_port
from libs.client.client import Client
from libs.contracts import names
from libs.contracts.api import ApplyRequest
from libs.contracts.base import encode, now
from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.fleet import NodeHealth, NodeRecord
from libs.contracts.jobs import ConditionType, Job, Phase
from services.placer.config import PlacerConfig, load_config
from services.placer.planner import Candidates, Exclusions, Planner
from tests.factories import job as make_job
from tests.factories import machine as make_machine
from tests.factories import node_record

REPO = Path(libs.__file__).resolve().parent.parent
ECHO_SUBJECT = "bench.echo"
BASELINE_BUCKET = "nodus-bench-baseline"
PLACER_SERVICE = "nodus-placer"
# A client's default apply timeout (libs.client.Client.apply): replies slower than this would
# have been errors for a user; the bench waits longer so it can measure them.
CLIENT_DEFAULT_APPLY_TIMEOUT = 10.0
# Sequential KV round trips one placement waits on in Placer._commit (get; leases; epoch;
# join keys; job update; ranktable; event), Relayed claims not counted.
SERIAL_KV_OPS_PER_PLACEMENT = 7


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# -- the fleet ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pool:
    provider: str
    region: str
    region_class: str
    offering: str
    private_network: str | None
    backend: str
    model: str
    count: int
    weight: float


# Providers, regions and region classes as a mixed real fleet has them: VMs on a VPC (Private
# gangs), VMs without a private network (Direct), container-only marketplaces (Relayed), CUDA
# and ROCm. Under a third of the machines have a private network: the Private path, tried
# first, runs out and Direct takes over.
POOLS = [
    Pool("aws", "us-east-1", "us", "vm", "aws-use1-vpc", "cuda", "H100", 8, 8),
    Pool("aws", "us-east-1", "us", "vm", "aws-use1-vpc", "cuda", "A100", 8, 4),
    Pool("aws", "us-west-2", "us", "vm", None, "cuda", "H100", 8, 5),
    Pool("aws", "us-west-2", "us", "vm", None, "cuda", "L4", 1, 3),
    Pool("aws", "eu-west-1", "eu", "vm", "aws-euw1-vpc", "cuda", "A100", 8, 4),
    Pool("aws", "ap-northeast-1", "ap", "vm", None, "cuda", "H100", 8, 3),
    Pool("gcp", "us-central1", "us", "vm", None, "cuda", "H100", 8, 6),
    Pool("gcp", "us-central1", "us", "vm", None, "cuda", "L4", 1, 3),
    Pool("gcp", "europe-west4", "eu", "vm", None, "cuda", "A100", 8, 4),
    Pool("gcp", "asia-southeast1", "ap", "vm", "gcp-asse1-vpc", "cuda", "L4", 1, 2),
    Pool("azure", "eastus", "us", "vm", "az-eastus-vnet", "rocm", "MI300X", 8, 5),
    Pool("azure", "eastus", "us", "vm", "az-eastus-vnet", "cuda", "H100", 8, 4),
    Pool("azure", "westeurope", "eu", "vm", "az-weu-vnet", "rocm", "MI300X", 8, 4),
    Pool("lambda", "us-west-1", "us", "vm", None, "cuda", "H100", 8, 5),
    Pool("lambda", "us-west-1", "us", "vm", None, "cuda", "A100", 8, 4),
    Pool("lambda", "eu-central-1", "eu", "vm", None, "cuda", "A100", 8, 3),
    Pool("coreweave", "us-east-4", "us", "vm", None, "cuda", "H100", 8, 6),
    Pool("tensorwave", "us-west-3", "us", "vm", None, "rocm", "MI300X", 8, 4),
    Pool("vast", "us-east-2", "us", "container", None, "cuda", "RTX4090", 1, 5),
    Pool("vast", "eu-south-1", "eu", "container", None, "cuda", "RTX4090", 1, 3),
    Pool("vast", "ap-south-1", "ap", "container", None, "cuda", "A100", 8, 2),
    Pool("runpod", "us-texas-1", "us", "container", None, "cuda", "H100", 8, 3),
    Pool("runpod", "eu-ro-1", "eu", "container", None, "rocm", "MI300X", 8, 2),
]
# A scarce model, a fixed number of machines whatever the fleet size: the jobs asking for it
# outnumber it, so some are left Unschedulable (a decision too, and the costliest: every path
# scans the whole free view).
SCARCE = Pool("coreweave", "us-east-4", "us", "vm", None, "cuda", "B200", 8, 0)
SCARCE_MACHINES = 24
# Share of VMs whose agent is older and lacks `wireguard-device` (C6): Private path only.
OLD_AGENT_SHARE = 0.02
BASE_CAPABILITIES = ["register", "heartbeat", "join-epoch"]


def _address(index: int, first: int, second_base: int) -> str:
    """Unique unicast addresses: index -> first.(second_base + hi).mid.low, low in 1..250."""
    block, low = divmod(index, 250)
    hi, mid = divmod(block, 250)
    return f"{first}.{second_base + hi}.{mid}.{low + 1}"


def build_fleet(machines: int, rng: random.Random) -> list[NodeRecord]:
    """`machines` node records over POOLS (plus the scarce pool), in a random order."""
    scarce = min(SCARCE_MACHINES, max(0, machines // 40))
    rest = machines - scarce
    total_weight = sum(p.weight for p in POOLS)
    counts = [int(rest * p.weight / total_weight) for p in POOLS]
    for i in range(rest - sum(counts)):  # the remainder, one each from the first pools
        counts[i % len(counts)] += 1
    plan = [(p, n) for p, n in zip(POOLS, counts, strict=True)] + [(SCARCE, scarce)]
    specs: list[tuple[Pool, int]] = []
    for pool, n in plan:
        specs.extend((pool, i) for i in range(n))
    rng.shuffle(specs)  # agents register in no particular order
    records: list[NodeRecord] = []
    per_pool: Counter[str] = Counter()
    for index, (pool, _) in enumerate(specs):
        prefix = f"{pool.provider}-{pool.region}-{pool.model.lower()}"
        per_pool[prefix] += 1
        fields: dict[str, Any] = {
            "provider": pool.provider,
            "region": pool.region,
            "regionClass": pool.region_class,
            "offering": pool.offering,
            "address": _address(index, 10, 0),
            "pool": f"{pool.model.lower()}-{pool.region_class}",
            "cluster": f"{pool.provider}-{pool.region}",
            "accelerators": {"count": pool.count, "backend": pool.backend, "model": pool.model},
        }
        if pool.private_network:
            fields["privateNetwork"] = pool.private_network
            fields["privateAddress"] = _address(index, 172, 16)
            fields["privateInterface"] = "ens5"
        m = make_machine(f"{prefix}-{per_pool[prefix]:05d}", **fields)
        capabilities = None
        if pool.offering == "vm" and rng.random() < OLD_AGENT_SHARE:
            capabilities = list(BASE_CAPABILITIES)
        records.append(
            node_record(m, capabilities=capabilities, namespace=f"netns-{pool.provider}")
        )
    return records


def fleet_summary(records: list[NodeRecord]) -> dict[str, Any]:
    invs = [r.inventory for r in records]
    return {
        "machines": len(records),
        "providers": len({i.provider for i in invs}),
        "regions": len({(i.provider, i.region) for i in invs}),
        "region_classes": sorted({i.region_class for i in invs}),
        "private_networks": len({i.private_network for i in invs if i.private_network}),
        "offering": dict(Counter(i.offering for i in invs)),
        "backend": dict(Counter(i.accelerators.backend for i in invs)),
        "with_private_network": sum(1 for i in invs if i.private_network),
        "without_wireguard_capability": sum(
            1
            for r in records
            if r.inventory.offering == "vm" and "wireguard-device" not in r.capabilities
        ),
        "unique_addresses": len({i.address for i in invs}) == len(invs),
    }


# -- the jobs ----------------------------------------------------------------------------------

ORGS = ["acme", "globex", "initech", "umbrella", "hooli"]
# (weight, accelerators, fixed members or None, fixed network or None, fixed transport or None)
JOB_SHAPES: list[tuple[float, dict[str, Any], int | None, str | None, str | None]] = [
    (20, {}, None, None, None),
    (22, {"backend": "cuda"}, None, None, None),
    (22, {"count": 8, "backend": "cuda", "model": "H100"}, None, None, None),
    (10, {"count": 8, "model": "A100"}, None, None, None),
    (8, {"count": 8, "backend": "rocm", "model": "MI300X"}, None, None, None),
    (4, {"backend": "rocm"}, None, None, None),
    (5, {"count": 1, "model": "L4"}, None, None, None),
    # Only container-only machines have RTX4090s: two members, transport Auto -> Relayed.
    (8, {"count": 1, "model": "RTX4090"}, 2, None, "Auto"),
    # More demand than SCARCE_MACHINES: some of these are left Unschedulable.
    (2, {"count": 8, "model": "B200"}, None, "Colocated", "Direct"),
]
MEMBERS = [(2, 30), (3, 10), (4, 25), (5, 5), (6, 10), (7, 5), (8, 15)]
NETWORKS = [("Colocated", 40), ("Regional", 35), ("Global", 25)]
TRANSPORTS = [("Direct", 60), ("Auto", 40)]


def _pick(rng: random.Random, weighted: Sequence[tuple[Any, float]]) -> Any:
    return rng.choices([v for v, _ in weighted], weights=[w for _, w in weighted])[0]


def build_jobs(count: int, rng: random.Random, prefix: str = "bench") -> list[Job]:
    jobs: list[Job] = []
    shapes = [(shape, shape[0]) for shape in JOB_SHAPES]
    for i in range(count):
        _, accelerators, members, network, transport = _pick(rng, shapes)
        members = members or _pick(rng, MEMBERS)
        env = {"NCCL_DEBUG": "WARN", "BENCH_INDEX": str(i)}
        if rng.random() < 0.3:
            env["NCCL_MIN_NCHANNELS"] = "4"
        jobs.append(
            make_job(
                f"{prefix}-{i:05d}",
                org=ORGS[i % len(ORGS)],
                command=["torchrun", "train.py", f"--seed={i}"],
                distributed={
                    "members": members,
                    "network": network or _pick(rng, NETWORKS),
                    "transport": transport or _pick(rng, TRANSPORTS),
                },
                accelerators=accelerators,
                env=env,
            )
        )
    return jobs


def job_summary(jobs: list[Job]) -> dict[str, Any]:
    members = [j.spec.distributed.members for j in jobs]
    return {
        "jobs": len(jobs),
        "members_total": sum(members),
        "members": dict(sorted(Counter(members).items())),
        "network": dict(Counter(j.spec.distributed.network for j in jobs)),
        "transport": dict(Counter(j.spec.distributed.transport for j in jobs)),
    }


# -- statistics --------------------------------------------------------------------------------


def percentile(values: list[float], p: float) -> float | None:
    """Nearest rank."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def dist_ms(seconds: list[float]) -> dict[str, Any]:
    ms = [s * 1000 for s in seconds]
    if not ms:
        return {"n": 0}
    return {
        "n": len(ms),
        "p50": round(percentile(ms, 50) or 0, 3),
        "p90": round(percentile(ms, 90) or 0, 3),
        "p99": round(percentile(ms, 99) or 0, 3),
        "max": round(max(ms), 3),
        "mean": round(sum(ms) / len(ms), 3),
    }


def ratio(a: Any, b: Any) -> float | None:
    if not a or not b:
        return None
    return round(float(a) / float(b), 1)


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of a process from /proc (Linux); None elsewhere or once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def scrape(port: int) -> dict[str, float]:
    """The placer's /metrics, flattened: 'name{labels}' -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    metrics: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                metrics[name] = float(value)
    return metrics


# -- processes ---------------------------------------------------------------------------------


class Child:
    """A subprocess this bench started, in its own session; stopped by its own pid only."""

    def __init__(self, name: str, args: list[str], log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        with open(log_path, "ab") as out:
            self.process = subprocess.Popen(
                args,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=REPO,
                start_new_session=True,
            )
        self.started = time.perf_counter()

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, grace: float = 15.0) -> int | None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                log(f"{self.name} ignored SIGTERM for {grace:g}s; killing pid {self.pid}")
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class Processes:
    """Everything the run started; `stop` is idempotent, so the outer bound can always call it."""

    def __init__(self) -> None:
        self.server: NatsServer | None = None
        self.children: list[Child] = []
        self.exit_codes: dict[str, int | None] = {}

    def stop(self) -> None:
        for child in reversed(self.children):
            self.exit_codes.setdefault(child.name, child.stop())
        if self.server is not None:
            self.server.stop()


def placer_log_summary(path: Path) -> dict[str, Any]:
    levels: Counter[str] = Counter()
    ready: str | None = None
    problems: list[str] = []
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return {}
    for line in text.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if not isinstance(entry, dict):
            continue
        level = str(entry.get("level", ""))
        levels[level] += 1
        message = str(entry.get("msg", ""))
        if " ready with " in message:
            ready = message
        if level in ("warning", "error", "critical") and len(problems) < 5:
            problems.append(message[:300])
    return {"levels": dict(levels), "ready_line": ready, "first_problems": problems}


async def _serve_echo(url: str) -> None:
    """The baseline's other end: a trivial request/reply responder in its own process."""
    nc = await nats.connect(url, name="bench-echo")

    async def echo(msg: Any) -> None:
        await msg.respond(msg.data)

    await nc.subscribe(ECHO_SUBJECT, cb=echo)
    await nc.flush()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await nc.close()


# -- the run -----------------------------------------------------------------------------------


@dataclass
class Options:
    machines: int = 10_000
    jobs: int = 1_000
    clients: int = 4
    seed: int = 1
    timeout: float = 600.0
    apply_timeout: float = 60.0
    rtt_samples: int = 1000
    kv_samples: int = 500
    profile_placer: Path | None = None
    keep_dir: bool = False
    quick: bool = False


@dataclass
class Burst:
    sent: dict[str, float] = field(default_factory=dict)  # perf_counter at send
    sent_wall: dict[str, float] = field(default_factory=dict)
    replied: dict[str, float] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)  # key -> error code
    placed_seen: dict[str, float] = field(default_factory=dict)  # perf_counter at first Placed
    placed_wall: dict[str, float] = field(default_factory=dict)  # status.placedTime
    unschedulable: dict[str, float] = field(default_factory=dict)
    paths: dict[str, str] = field(default_factory=dict)


async def _wait_until(check: Any, within: float, interval: float, what: str) -> None:
    deadline = time.perf_counter() + within
    while time.perf_counter() < deadline:
        if await check():
            return
        await asyncio.sleep(interval)
    raise TimeoutError(f"{what} within {within:g}s")


async def _register(bus: Bus, records: list[NodeRecord], chunk: int = 1000) -> None:
    """What agents do at start: the inventory into nodes, a fresh heartbeat into health."""
    nodes = bus.bucket(names.BUCKET_NODES, NodeRecord)
    health = bus.bucket(names.BUCKET_HEALTH, NodeHealth)
    t = now()
    for start in range(0, len(records), chunk):
        part = records[start : start + chunk]
        await asyncio.gather(*(nodes.put(r.inventory.node, r) for r in part))
        await asyncio.gather(
            *(
                health.put(
                    r.inventory.node,
                    NodeHealth(node=r.inventory.node, healthy=True, heartbeat_time=t),
                )
                for r in part
            )
        )


async def _ping_placer(bus: Bus) -> bool:
    try:
        await bus.nc.request(f"$SRV.PING.{PLACER_SERVICE}", b"", timeout=0.5)
        return True
    except Exception:  # no responders yet, or a timeout while it loads
        return False


async def _baseline(
    opts: Options, bus: Bus, clients: list[Client], sample_job: Job
) -> dict[str, Any]:
    """NATS request/reply and KV round trips on this server, placer idle."""
    nc = bus.nc
    payload = encode(ApplyRequest(job=sample_job))  # an apply-sized body
    await _wait_until(
        lambda: _echo_ok(nc, payload), 15.0, 0.05, "the echo responder did not answer"
    )
    for _ in range(50):  # warm up
        await nc.request(ECHO_SUBJECT, payload, timeout=5)
    rtt: list[float] = []
    for _ in range(opts.rtt_samples):
        t0 = time.perf_counter()
        await nc.request(ECHO_SUBJECT, payload, timeout=5)
        rtt.append(time.perf_counter() - t0)

    # The same burst shape as the applies: every request at once, over the client connections.
    burst: list[float] = []

    async def one(i: int) -> None:
        t0 = time.perf_counter()
        await clients[i % len(clients)].bus.nc.request(ECHO_SUBJECT, payload, timeout=60)
        burst.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(opts.jobs)))
    burst_wall = time.perf_counter() - t0

    kv = await bus.js.create_key_value(
        KeyValueConfig(bucket=BASELINE_BUCKET, history=10, storage=StorageType.FILE)
    )
    record = encode(sample_job)
    puts: list[float] = []
    gets: list[float] = []
    for i in range(opts.kv_samples):
        t0 = time.perf_counter()
        await kv.put(f"k{i}", record)
        puts.append(time.perf_counter() - t0)
    for i in range(opts.kv_samples):
        t0 = time.perf_counter()
        await kv.get(f"k{i}")
        gets.append(time.perf_counter() - t0)
    await bus.js.delete_key_value(BASELINE_BUCKET)
    return {
        "payload_bytes": len(payload),
        "nats_rtt_ms": dist_ms(rtt),
        "nats_rtt_burst_ms": {
            **dist_ms(burst),
            "wall_s": round(burst_wall, 3),
            "per_second": round(len(burst) / burst_wall, 1),
        },
        "kv_put_ms": dist_ms(puts),
        "kv_get_ms": dist_ms(gets),
        "kv_record_bytes": len(record),
    }


async def _echo_ok(nc: Any, payload: bytes) -> bool:
    try:
        await nc.request(ECHO_SUBJECT, payload, timeout=0.5)
        return True
    except Exception:
        return False


async def _watch_jobs(bus: Bus, burst: Burst, wanted: set[str], done: asyncio.Event) -> None:
    """Timestamp the first record of each burst job that is Placed (or Unschedulable)."""
    jobs = bus.bucket(names.BUCKET_JOBS, Job)
    async for change in jobs.watch():
        t = time.perf_counter()
        job = change.value
        if job is None or change.key not in wanted or change.key in burst.placed_seen:
            continue
        if job.status.phase is not Phase.PENDING:
            burst.placed_seen[change.key] = t
            burst.unschedulable.pop(change.key, None)
            if job.status.placed_time is not None:
                burst.placed_wall[change.key] = job.status.placed_time.timestamp()
            if job.status.gang is not None:
                burst.paths[change.key] = job.status.gang.transport.value
        else:
            ready = job.condition(ConditionType.GANG_READY)
            if ready and ready.status == "False" and ready.reason == "Unschedulable":
                burst.unschedulable.setdefault(change.key, t)
        decided = len(burst.placed_seen) + len(burst.unschedulable) + len(burst.refused)
        if decided >= len(wanted):
            done.set()


async def _apply_all(clients: list[Client], jobs: list[Job], burst: Burst, limit: float) -> None:
    async def one(index: int, job: Job) -> None:
        client = clients[index % len(clients)]
        burst.sent_wall[job.key] = time.time()
        burst.sent[job.key] = time.perf_counter()
        try:
            await client.apply(job, timeout=limit)
        except NodusError as error:
            burst.refused[job.key] = error.code.value
        burst.replied[job.key] = time.perf_counter()

    await asyncio.gather(*(one(i, job) for i, job in enumerate(jobs)))


async def _run(
    opts: Options, result: dict[str, Any], workdir: Path, processes: Processes, started: float
) -> None:
    rng = random.Random(opts.seed)
    t0 = time.perf_counter()
    fleet = build_fleet(opts.machines, rng)
    jobs = build_jobs(opts.jobs, rng)
    result["fleet"] = fleet_summary(fleet)
    result["jobs"] = job_summary(jobs)
    result["generate_s"] = round(time.perf_counter() - t0, 3)
    log(f"generated {len(fleet)} machines and {len(jobs)} jobs in {result['generate_s']}s")

    server = processes.server = NatsServer(workdir / "nats").start()
    children = processes.children
    buses: list[Bus] = []
    watch_task: asyncio.Task[None] | None = None
    try:
        bus = await Bus.open(server.url, name="bench", buckets=names.ALL_BUCKETS, streams=True)
        buses.append(bus)

        t0 = time.perf_counter()
        await _register(bus, fleet)
        registration = time.perf_counter() - t0
        result["fleet"]["registration_s"] = round(registration, 3)
        result["fleet"]["registration_kv_puts_per_s"] = round(2 * len(fleet) / registration, 1)
        log(f"registered {len(fleet)} machines (nodes + health) in {registration:.2f}s")

        # The same ordered-consumer read the placer does at start, from this process.
        t0 = time.perf_counter()
        await bus.bucket(names.BUCKET_NODES, NodeRecord).snapshot()
        await bus.bucket(names.BUCKET_HEALTH, NodeHealth).snapshot()
        result["fleet"]["snapshot_nodes_and_health_s"] = round(time.perf_counter() - t0, 3)

        config = load_config()
        config.distributed_access = ["*"]
        # Registered once: the heartbeats must stay fresh for the whole run.
        config.heartbeat_timeout_seconds = max(3600.0, opts.timeout * 4)
        result["planner_only"] = planner_only(config, fleet, jobs)
        log(f"planner alone: {result['planner_only']['plan_seconds_total']}s for {len(jobs)} plans")
        config_path = workdir / "placer.yaml"
        config_path.write_text(yaml.safe_dump(msgspec.to_builtins(config)))

        children.append(
            Child(
                "echo",
                [sys.executable, "-m", "tests.bench.placement", "--serve-echo", server.url],
                workdir / "echo.log",
            )
        )
        metrics_port = free_port()
        flags = {
            "--nats": server.url,
            "--config": str(config_path),
            "--replica": "bench-placer",
            "--metrics-port": str(metrics_port),
            "--log-format": "json",
        }
        placer_args = ["-m", "app", "placer", *(x for kv in flags.items() for x in kv)]
        if opts.profile_placer:
            placer_args = ["-m", "cProfile", "-o", str(opts.profile_placer), *placer_args]
        placer = Child("placer", [sys.executable, *placer_args], workdir / "placer.log")
        children.append(placer)
        spawned = placer.started
        log(f"placer started (pid {placer.pid}); waiting until it answers")

        async def placer_ready() -> bool:
            if not placer.alive():
                raise RuntimeError(
                    f"placer exited with {placer.process.returncode}:\n{placer.tail()}"
                )
            return await _ping_placer(bus)

        await _wait_until(placer_ready, opts.timeout, 0.05, "the placer did not answer $SRV.PING")
        ready_s = time.perf_counter() - spawned
        start: dict[str, Any] = {"spawn_to_ready_s": round(ready_s, 3)}
        result["placer_start"] = start
        log(f"placer answers after {ready_s:.2f}s; probing until its watches caught up")

        # Readiness comes after the snapshot; the watches then replay every node and heartbeat.
        # Two sentinel machines registered now reach the placer after that replay, in order: a
        # job only they can run is admitted once the node watch has caught up, and placed once
        # the health watch has too.
        sentinels = [
            node_record(
                make_machine(
                    f"bench-sentinel-{i}",
                    provider="bench",
                    region="sentinel",
                    regionClass="bench",
                    address=f"10.255.255.{i + 1}",
                    accelerators={"count": 1, "backend": "cuda", "model": "SENTINEL"},
                )
            )
            for i in range(2)
        ]
        await _register(bus, sentinels)
        probe = make_job(
            "bench-probe",
            org="bench",
            distributed={"members": 2, "network": "Colocated", "transport": "Direct"},
            accelerators={"count": 1, "model": "SENTINEL"},
        )
        for _ in range(opts.clients):
            client = await Client.connect(server.url)
            buses.append(client.bus)
        clients = [Client(b) for b in buses[1:]]
        probe_client = Client(bus)

        async def probe_admitted() -> bool:
            try:
                await probe_client.apply(probe, timeout=opts.apply_timeout)
                return True
            except NodusError as error:
                if error.code in (ErrorCode.UNSATISFIABLE, ErrorCode.TIMEOUT):
                    return False
                raise

        await _wait_until(probe_admitted, opts.timeout, 0.25, "the probe job was not admitted")
        admitted_s = time.perf_counter() - spawned
        jobs_bucket = bus.bucket(names.BUCKET_JOBS, Job)

        async def probe_placed() -> bool:
            found = await jobs_bucket.get(probe.key)
            return found is not None and found.value.status.phase is Phase.PLACED

        await _wait_until(probe_placed, opts.timeout, 0.02, "the probe job was not placed")
        loaded_s = time.perf_counter() - spawned
        start["spawn_to_node_watch_caught_up_s"] = round(admitted_s, 3)
        start["spawn_to_view_loaded_s"] = round(loaded_s, 3)
        start["ready_to_view_loaded_s"] = round(loaded_s - ready_s, 3)
        start["placer_cpu_s_to_view_loaded"] = cpu_seconds(placer.pid)
        log(f"placer view loaded {loaded_s:.2f}s after spawn (node watch at {admitted_s:.2f}s)")

        baseline = await _baseline(opts, bus, clients, jobs[0])
        result["baseline"] = baseline
        log(
            f"baseline: NATS RTT p50 {baseline['nats_rtt_ms']['p50']} ms, "
            f"KV put p50 {baseline['kv_put_ms']['p50']} ms"
        )

        burst = Burst()
        wanted = {job.key for job in jobs}
        done = asyncio.Event()
        watch_task = asyncio.create_task(_watch_jobs(bus, burst, wanted, done))
        await asyncio.sleep(0.2)  # the watch has replayed the (near empty) bucket
        metrics_before = await asyncio.to_thread(scrape, metrics_port)
        cpu_before = {
            "placer": cpu_seconds(placer.pid),
            "nats_server": cpu_seconds(server.process.pid) if server.process else None,
            "loadgen": time.process_time(),
        }
        log(f"applying {len(jobs)} jobs at once over {len(clients)} connections")
        burst_start = time.perf_counter()
        apply_task = asyncio.create_task(_apply_all(clients, jobs, burst, opts.apply_timeout))
        remaining = opts.timeout - (time.perf_counter() - started) - 15
        try:
            await asyncio.wait_for(done.wait(), timeout=max(remaining, 1.0))
        except TimeoutError:
            result["timed_out"] = True
            log("timed out waiting for decisions")
            apply_task.cancel()
        await asyncio.gather(apply_task, return_exceptions=True)
        burst_end = time.perf_counter()

        # The record says Placed before the worker has written the ranktable and the event and
        # observed its histogram: let the placer's own counters catch up (bounded).
        async def counters_caught_up() -> bool:
            m = await asyncio.to_thread(scrape, metrics_port)
            decisions = sum(
                m.get(f'nodus_placer_decisions_total{{outcome="{o}"}}', 0.0)
                - metrics_before.get(f'nodus_placer_decisions_total{{outcome="{o}"}}', 0.0)
                for o in ("placed", "unschedulable")
            )
            return decisions >= len(burst.placed_seen) + len(burst.unschedulable)

        with contextlib.suppress(TimeoutError):
            await _wait_until(counters_caught_up, 3.0, 0.05, "placer counters lag")
        cpu_after = {
            "placer": cpu_seconds(placer.pid),
            "nats_server": cpu_seconds(server.process.pid) if server.process else None,
            "loadgen": time.process_time(),
        }
        metrics_after = await asyncio.to_thread(scrape, metrics_port)
        result["placement"] = _placement_figures(burst, jobs, burst_start, burst_end)
        result["placer_internal"] = _internal_figures(metrics_before, metrics_after)
        result["cpu_s_during_burst"] = {
            k: None if v is None or (after := cpu_after[k]) is None else round(after - v, 2)
            for k, v in cpu_before.items()
        }
        result["ratios"] = _ratios(result)
        result["placer_log"] = placer_log_summary(placer.log_path)
        placement = result["placement"]
        log(
            f"placed {placement['placed']}, unschedulable {placement['unschedulable']}, "
            f"refused {placement['refused']}, undecided {placement['undecided']}; "
            f"{placement['decisions_per_second']} decisions/s"
        )
    finally:
        # Processes first (the placer drains against a live server), then our connections,
        # then the server; a second cancellation cannot skip the process stops.
        for child in reversed(children):
            processes.exit_codes.setdefault(child.name, child.stop())
        if watch_task is not None:
            watch_task.cancel()
        for b in buses:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(b.close(), timeout=5)
        server.stop()


def _placement_figures(burst: Burst, jobs: list[Job], start: float, end: float) -> dict[str, Any]:
    placed = burst.placed_seen
    to_placed = [placed[k] - burst.sent[k] for k in placed if k in burst.sent]
    recorded = [
        burst.placed_wall[k] - burst.sent_wall[k] for k in burst.placed_wall if k in burst.sent_wall
    ]
    apply_latency = [
        burst.replied[k] - burst.sent[k] for k in burst.replied if k not in burst.refused
    ]
    first_send = min(burst.sent.values(), default=start)
    last_placed = max(placed.values(), default=first_send)
    last_decision = max([*placed.values(), *burst.unschedulable.values()], default=first_send)
    placed_wall = last_placed - first_send
    decision_wall = last_decision - first_send
    decided = len(placed) + len(burst.unschedulable) + len(burst.refused)
    refused_codes = Counter(burst.refused.values())
    last_reply = max(burst.replied.values(), default=first_send)
    early = [t for t in placed.values() if t <= last_reply]
    return {
        "submitted": len(jobs),
        "placed": len(placed),
        "unschedulable": len(burst.unschedulable),
        "refused": len(burst.refused),
        "refused_codes": dict(refused_codes),
        "undecided": len(jobs) - decided,
        "paths": dict(Counter(burst.paths.values())),
        "machines_leased": sum(j.spec.distributed.members for j in jobs if j.key in placed),
        "wall_s_first_apply_to_last_placed": round(placed_wall, 3),
        "wall_s_first_apply_to_last_decision": round(decision_wall, 3),
        "decisions_per_second": round(len(placed) / placed_wall, 1) if placed_wall else None,
        "decisions_per_second_incl_unschedulable": round(
            (len(placed) + len(burst.unschedulable)) / decision_wall, 1
        )
        if decision_wall
        else None,
        "apply_to_placed_ms": dist_ms(to_placed),
        "apply_to_placed_recorded_ms": dist_ms(recorded),
        "apply_to_unschedulable_ms": dist_ms(
            [t - burst.sent[k] for k, t in burst.unschedulable.items() if k in burst.sent]
        ),
        "apply_reply_ms": dist_ms(apply_latency),
        "apply_replies_slower_than_client_default": sum(
            1 for s in apply_latency if s > CLIENT_DEFAULT_APPLY_TIMEOUT
        ),
        "last_apply_reply_s": round(last_reply - first_send, 3),
        # Applies and placements share the placer's event loop: the rate while applies are
        # still being answered, and once they all are.
        "placed_while_applying": len(early),
        "decisions_per_second_while_applying": round(len(early) / (last_reply - first_send), 1)
        if last_reply > first_send
        else None,
        "decisions_per_second_after_last_apply_reply": round(
            (len(placed) - len(early)) / (last_placed - last_reply), 1
        )
        if last_placed > last_reply
        else None,
        "burst_wall_s": round(end - start, 3),
    }


def planner_only(config: PlacerConfig, fleet: list[NodeRecord], jobs: list[Job]) -> dict[str, Any]:
    """The CPU floor of the decisions: the placer's own Planner over the same fleet and jobs,
    in this process, serially, no bus (taken machines leave the free view as leases would)."""
    planner = Planner(config)
    free = Candidates(fleet)  # the placer's own index of free machines
    times: list[float] = []
    outcomes: Counter[str] = Counter()
    for job in jobs:
        t0 = time.perf_counter()
        plan, _ = planner.plan(job, free, Exclusions())
        times.append(time.perf_counter() - t0)
        if plan is None:
            outcomes["unschedulable"] += 1
            continue
        outcomes[plan.path.value] += 1
        for node in plan.nodes:
            free.remove(node)
    total = sum(times)
    return {
        "plan_ms": dist_ms(times),
        "plan_seconds_total": round(total, 3),
        "decisions_per_second": round(len(times) / total, 1) if total else None,
        "outcomes": dict(outcomes),
    }


def _internal_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    count = delta("nodus_placer_place_seconds_count")
    total = delta("nodus_placer_place_seconds_sum")
    return {
        "place_calls": int(count),
        "place_seconds_total": round(total, 3),
        "place_ms_mean": round(1000 * total / count, 3) if count else None,
        "decisions": {
            outcome: int(delta(f'nodus_placer_decisions_total{{outcome="{outcome}"}}'))
            for outcome in ("placed", "unschedulable", "gave_up")
        },
        "admissions": {
            outcome: int(delta(f'nodus_placer_admissions_total{{outcome="{outcome}"}}'))
            for outcome in ("admitted", "refused", "unchanged")
        },
        "conflicts": {
            k.split('"')[1]: int(delta(k))
            for k in after
            if k.startswith("nodus_placer_conflicts_total{")
        },
    }


def _ratios(result: dict[str, Any]) -> dict[str, Any]:
    base = result.get("baseline", {})
    placement = result.get("placement", {})
    internal = result.get("placer_internal", {})
    planner = result.get("planner_only", {})
    rtt = base.get("nats_rtt_ms", {})
    burst = base.get("nats_rtt_burst_ms", {})
    kv = base.get("kv_put_ms", {})
    to_placed = placement.get("apply_to_placed_ms", {})
    reply = placement.get("apply_reply_ms", {})
    kv_floor_ms = (kv.get("p50") or 0) * SERIAL_KV_OPS_PER_PLACEMENT
    return {
        "apply_to_placed_p50_over_nats_rtt_p50": ratio(to_placed.get("p50"), rtt.get("p50")),
        "apply_to_placed_p99_over_nats_rtt_p99": ratio(to_placed.get("p99"), rtt.get("p99")),
        "apply_to_placed_p50_over_kv_put_p50": ratio(to_placed.get("p50"), kv.get("p50")),
        "apply_reply_p50_over_nats_rtt_p50": ratio(reply.get("p50"), rtt.get("p50")),
        "apply_reply_p99_over_burst_rtt_p99": ratio(reply.get("p99"), burst.get("p99")),
        "place_ms_mean_over_kv_put_p50": ratio(internal.get("place_ms_mean"), kv.get("p50")),
        "place_ms_mean_over_planner_only_plan_ms_mean": ratio(
            internal.get("place_ms_mean"), planner.get("plan_ms", {}).get("mean")
        ),
        # What one serial worker could reach if a placement cost only its KV round trips.
        "kv_floor_ms_per_placement": round(kv_floor_ms, 3) if kv_floor_ms else None,
        "kv_floor_decisions_per_second": round(1000 / kv_floor_ms, 1) if kv_floor_ms else None,
        "decisions_per_second_over_kv_floor": ratio(
            placement.get("decisions_per_second"), 1000 / kv_floor_ms if kv_floor_ms else None
        ),
    }


async def run(opts: Options) -> dict[str, Any]:
    """One bounded run: always stops what it started; `timed_out` says if it was cut short."""
    result: dict[str, Any] = {
        "bench": "placement",
        "params": {
            "machines": opts.machines,
            "jobs": opts.jobs,
            "clients": opts.clients,
            "seed": opts.seed,
            "quick": opts.quick,
            "timeout_s": opts.timeout,
            "placer_profiled": bool(opts.profile_placer),
        },
        "environment": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "event_loop": type(asyncio.get_running_loop()).__module__.split(".")[0],
        },
        "timed_out": False,
    }
    started = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="nodus-bench-"))
    result["workdir"] = str(workdir)
    processes = Processes()
    task = asyncio.create_task(_run(opts, result, workdir, processes, started))
    try:
        done, _ = await asyncio.wait({task}, timeout=opts.timeout)
        if not done:
            result["timed_out"] = True
            result["error"] = f"the run did not finish within {opts.timeout:g}s"
            log(result["error"])
            # Python 3.11's wait_for can swallow a cancellation that races a result: insist.
            for _ in range(30):
                task.cancel()
                done, _ = await asyncio.wait({task}, timeout=1.0)
                if done:
                    break
        if done and not task.cancelled() and task.exception() is not None:
            error = task.exception()
            result["error"] = f"{type(error).__name__}: {error}"
    finally:
        if not task.done():
            task.cancel()
        processes.stop()  # idempotent; the run's own finally normally did it already
        result["placer_exit_code"] = processes.exit_codes.get("placer")
        placer_log = workdir / "placer.log"
        if "placer_log" not in result and placer_log.exists():
            result["placer_log"] = placer_log_summary(placer_log)
        result["total_s"] = round(time.perf_counter() - started, 3)
        if not opts.keep_dir:
            shutil.rmtree(workdir, ignore_errors=True)
            result.pop("workdir", None)
    return result


def completed(result: dict[str, Any]) -> bool:
    placement = result.get("placement", {})
    return (
        not result.get("timed_out")
        and "error" not in result
        and bool(placement)
        and placement.get("undecided") == 0
    )


def print_profile(path: Path, lines: int = 30) -> None:
    import pstats

    try:
        stats = pstats.Stats(str(path), stream=sys.stderr)
    except (OSError, TypeError, EOFError) as error:
        log(f"no placer profile at {path}: {error}")
        return
    stats.sort_stats("tottime").print_stats(lines)
    stats.sort_stats("cumulative").print_stats(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tests.bench.placement",
        description="Placement benchmark: prints one JSON object on stdout.",
    )
    parser.add_argument("--machines", type=int, help="fleet size (default 10000; --quick 1000)")
    parser.add_argument("--jobs", type=int, help="jobs applied at once (default 1000; --quick 100)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1000 machines, 100 jobs")
    parser.add_argument("--clients", type=int, default=4, help="client connections (default 4)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout", type=float, help="whole-run bound in seconds (default 600)")
    parser.add_argument(
        "--apply-timeout", type=float, default=60.0, help="per-apply request timeout (default 60)"
    )
    parser.add_argument(
        "--profile-placer",
        type=Path,
        help="run the placer under cProfile, write its stats here and print the top to stderr",
    )
    parser.add_argument("--keep-dir", action="store_true", help="keep logs and the NATS store")
    parser.add_argument("--serve-echo", metavar="URL", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def options_from(args: argparse.Namespace) -> Options:
    quick = bool(args.quick)
    return Options(
        machines=args.machines or (1_000 if quick else 10_000),
        jobs=args.jobs or (100 if quick else 1_000),
        clients=max(1, args.clients),
        seed=args.seed,
        timeout=args.timeout or (180.0 if quick else 600.0),
        apply_timeout=args.apply_timeout,
        rtt_samples=300 if quick else 1000,
        kv_samples=200 if quick else 500,
        profile_placer=args.profile_placer.resolve() if args.profile_placer else None,
        keep_dir=args.keep_dir,
        quick=quick,
    )


def main(argv: list[str] | None = None) -> int:
    import uvloop

    args = parse_args(argv)
    if args.serve_echo:
        uvloop.run(_serve_echo(args.serve_echo))
        return 0
    opts = options_from(args)

    async def bounded() -> dict[str, Any]:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            if task is not None:
                loop.add_signal_handler(sig, task.cancel)
        return await run(opts)

    try:
        result = uvloop.run(bounded())
    except asyncio.CancelledError:
        print(json.dumps({"bench": "placement", "error": "interrupted"}))
        return 1
    print(json.dumps(result, indent=2))
    if opts.profile_placer:
        print_profile(opts.profile_placer)
    return 0 if completed(result) else 1


if __name__ == "__main__":
    sys.exit(main())

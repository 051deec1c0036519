"""The placement bench's harness: the processes it starts (nats-server, an echo responder, the
placer), registering the fleet as agents do, the idle baseline (NATS and KV round trips), and
the burst itself: every job applied at once while a watch timestamps each decision. See
tests/bench/placement.py."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import yaml
from nats.js.api import KeyValueConfig, StorageType

import libs
from libs.bus import Bus
from libs.bus.connection import connect
from libs.bus.server import NatsServer, free_port
from libs.client.client import Client
from libs.contracts import names
from libs.contracts.api import ApplyRequest
from libs.contracts.base import encode, now
from libs.contracts.epochs import Epoch, Lease
from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.fleet import NodeHealth, NodeRecord
from libs.contracts.jobs import ConditionType, Job, PathClass, Phase
from services.placer.config import load_config
from tests.bench.placement_relays import BENCH_RELAYS, announce_relays, homed_near
from tests.bench.placement_report import (
    Burst,
    dist_ms,
    internal_figures,
    placement_figures,
    placer_log_summary,
    planner_only,
    ratios,
    scrape_all,
)
from tests.bench.placement_workload import build_fleet, build_jobs, fleet_summary, job_summary
from tests.bench.sampling import process_cpu
from tests.factories import job as make_job
from tests.factories import machine as make_machine
from tests.factories import node_record

REPO = Path(libs.__file__).resolve().parent.parent
ECHO_SUBJECT = "bench.echo"
BASELINE_BUCKET = "nodus-bench-baseline"
PLACER_SERVICE = "nodus-placer"


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


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


async def serve_echo(url: str) -> None:
    """The baseline's other end: a trivial request/reply responder in its own process."""
    nc = await connect(url, name="bench-echo")

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
    replicas: int = 1  # placer processes sharing the applies (the API's queue group)
    relays: int = len(BENCH_RELAYS)  # relays announced before the burst (0: none)


def placer_name(index: int) -> str:
    """The first placer keeps the single-replica run's names (`placer`, `placer.log`)."""
    return "placer" if index == 0 else f"placer-{index}"


def cpu_now(placers: list[Child], server: NatsServer) -> dict[str, float | None]:
    """CPU seconds so far of the placers (all replicas), nats-server and this process (the
    load generator)."""
    each = [process_cpu(placer.pid) for placer in placers]
    return {
        "placer": None if None in each else sum(c for c in each if c is not None),
        "nats_server": process_cpu(server.process.pid) if server.process else None,
        "loadgen": time.process_time(),
    }


async def wait_until(check: Any, within: float, interval: float, what: str) -> None:
    deadline = time.perf_counter() + within
    while time.perf_counter() < deadline:
        if await check():
            return
        await asyncio.sleep(interval)
    raise TimeoutError(f"{what} within {within:g}s")


async def register(bus: Bus, records: list[NodeRecord], chunk: int = 1000) -> None:
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


async def placers_answering(bus: Bus, window: float = 0.3) -> int:
    """How many placer replicas answer `$SRV.PING` (each answers once) within `window`."""
    inbox = bus.nc.new_inbox()
    answers: set[bytes] = set()

    async def answered(msg: Any) -> None:
        if msg.data:  # not the server's empty "no responders" status
            answers.add(msg.data)

    subscription = await bus.nc.subscribe(inbox, cb=answered)
    try:
        await bus.nc.publish(f"$SRV.PING.{PLACER_SERVICE}", b"", reply=inbox)
        await asyncio.sleep(window)
    finally:
        await subscription.unsubscribe()
    return len(answers)


async def one_placement_per_job(bus: Bus, wanted: set[str]) -> dict[str, Any]:
    """R14 after the burst: every job placed has one live epoch, the one it names, and every
    machine of it is leased to that epoch; no machine is in two live epochs."""
    jobs = await bus.bucket(names.BUCKET_JOBS, Job).snapshot()
    epochs = await bus.bucket(names.BUCKET_EPOCHS, Epoch).snapshot()
    leases = await bus.bucket(names.BUCKET_LEASES, Lease).snapshot()
    live: dict[str, list[Epoch]] = {}
    for stored in epochs.values():
        if not stored.value.fenced:
            live.setdefault(stored.value.gang, []).append(stored.value)
    problems: list[str] = []
    holders: dict[str, str] = {}
    placed = 0
    for key in sorted(wanted):
        found = jobs.get(key)
        if found is None or found.value.status.phase is not Phase.PLACED:
            continue
        placed += 1
        epoch = found.value.status.epoch
        mine = live.get(key, [])
        numbers = sorted(e.epoch for e in mine)
        if numbers != [epoch]:
            problems.append(f"{key} is Placed at epoch {epoch}; live epochs {numbers}")
            continue
        for member in mine[0].members:
            lease = leases.get(member.node)
            if lease is None or (lease.value.gang, lease.value.epoch) != (key, epoch):
                held = None if lease is None else (lease.value.gang, lease.value.epoch)
                problems.append(f"{member.node} of {key} epoch {epoch} is leased to {held}")
            other = holders.setdefault(member.node, key)
            if other != key:
                problems.append(f"{member.node} is in {other} and {key}")
    return {"placed_checked": placed, "ok": not problems, "problems": problems[:20]}


async def measure_baseline(
    opts: Options, bus: Bus, clients: list[Client], sample_job: Job
) -> dict[str, Any]:
    """NATS request/reply and KV round trips on this server, placer idle."""
    nc = bus.nc
    payload = encode(ApplyRequest(job=sample_job))  # an apply-sized body
    await wait_until(lambda: echo_ok(nc, payload), 15.0, 0.05, "the echo responder did not answer")
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


async def echo_ok(nc: Any, payload: bytes) -> bool:
    try:
        await nc.request(ECHO_SUBJECT, payload, timeout=0.5)
        return True
    except Exception:
        return False


async def watch_jobs(bus: Bus, burst: Burst, wanted: set[str], done: asyncio.Event) -> None:
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
                gang = job.status.gang
                burst.named_relays += bool(gang.relays)
                if gang.transport is PathClass.RELAYED and gang.relays:
                    burst.relay_homes += [
                        (m.node, gang.relays[m.relay_slot])
                        for m in gang.members
                        if m.relay_slot is not None
                    ]
        else:
            ready = job.condition(ConditionType.GANG_READY)
            if ready and ready.status == "False" and ready.reason == "Unschedulable":
                burst.unschedulable.setdefault(change.key, t)
        decided = len(burst.placed_seen) + len(burst.unschedulable) + len(burst.refused)
        if decided >= len(wanted):
            done.set()


async def apply_all(clients: list[Client], jobs: list[Job], burst: Burst, limit: float) -> None:
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


async def measure(
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
    # Authentication is on: this bench and the processes it starts are the bus's operator.
    os.environ["NODUS_CREDENTIALS"] = server.credentials or ""
    children = processes.children
    buses: list[Bus] = []
    watch_task: asyncio.Task[None] | None = None
    try:
        bus = await Bus.open(server.url, name="bench", buckets=names.ALL_BUCKETS, streams=True)
        buses.append(bus)

        t0 = time.perf_counter()
        await register(bus, fleet)
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
        metrics_ports = [free_port() for _ in range(opts.replicas)]
        placers: list[Child] = []
        for index, port in enumerate(metrics_ports):
            name = placer_name(index)
            flags = {
                "--nats": server.url,
                "--config": str(config_path),
                "--replica": f"bench-{name}",
                "--metrics-port": str(port),
                "--log-format": "json",
            }
            placer_args = ["-m", "app", "placer", *(x for kv in flags.items() for x in kv)]
            if opts.profile_placer and index == 0:
                placer_args = ["-m", "cProfile", "-o", str(opts.profile_placer), *placer_args]
            placers.append(Child(name, [sys.executable, *placer_args], workdir / f"{name}.log"))
        children.extend(placers)
        placer = placers[0]
        spawned = placer.started
        pids = ", ".join(str(p.pid) for p in placers)
        log(f"placer started (pid {pids}); waiting until it answers")

        async def placer_ready() -> bool:
            for each in placers:
                if not each.alive():
                    raise RuntimeError(
                        f"{each.name} exited with {each.process.returncode}:\n{each.tail()}"
                    )
            return await placers_answering(bus) >= len(placers)

        await wait_until(placer_ready, opts.timeout, 0.05, "the placer did not answer $SRV.PING")
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
        await register(bus, sentinels)
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

        await wait_until(probe_admitted, opts.timeout, 0.25, "the probe job was not admitted")
        admitted_s = time.perf_counter() - spawned
        jobs_bucket = bus.bucket(names.BUCKET_JOBS, Job)

        async def probe_placed() -> bool:
            found = await jobs_bucket.get(probe.key)
            return found is not None and found.value.status.phase is Phase.PLACED

        await wait_until(probe_placed, opts.timeout, 0.02, "the probe job was not placed")
        loaded_s = time.perf_counter() - spawned
        start["spawn_to_node_watch_caught_up_s"] = round(admitted_s, 3)
        start["spawn_to_view_loaded_s"] = round(loaded_s, 3)
        start["ready_to_view_loaded_s"] = round(loaded_s - ready_s, 3)
        start["placer_cpu_s_to_view_loaded"] = cpu_now(placers, server)["placer"]
        log(f"placer view loaded {loaded_s:.2f}s after spawn (node watch at {admitted_s:.2f}s)")

        await announce_relays(bus, opts.relays)
        baseline = await measure_baseline(opts, bus, clients, jobs[0])
        result["baseline"] = baseline
        log(
            f"baseline: NATS RTT p50 {baseline['nats_rtt_ms']['p50']} ms, "
            f"KV put p50 {baseline['kv_put_ms']['p50']} ms"
        )

        burst = Burst()
        wanted = {job.key for job in jobs}
        done = asyncio.Event()
        watch_task = asyncio.create_task(watch_jobs(bus, burst, wanted, done))
        await asyncio.sleep(0.2)  # the watch has replayed the (near empty) bucket
        metrics_before = await asyncio.to_thread(scrape_all, metrics_ports)
        cpu_before = cpu_now(placers, server)
        log(f"applying {len(jobs)} jobs at once over {len(clients)} connections")
        burst_start = time.perf_counter()
        apply_task = asyncio.create_task(apply_all(clients, jobs, burst, opts.apply_timeout))
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
            m = await asyncio.to_thread(scrape_all, metrics_ports)
            decisions = sum(
                m.get(f'nodus_placer_decisions_total{{outcome="{o}"}}', 0.0)
                - metrics_before.get(f'nodus_placer_decisions_total{{outcome="{o}"}}', 0.0)
                for o in ("placed", "unschedulable")
            )
            return decisions >= len(burst.placed_seen) + len(burst.unschedulable)

        with contextlib.suppress(TimeoutError):
            await wait_until(counters_caught_up, 3.0, 0.05, "placer counters lag")
        cpu_after = cpu_now(placers, server)
        metrics_after = await asyncio.to_thread(scrape_all, metrics_ports)
        result["placement"] = placement_figures(burst, jobs, burst_start, burst_end)
        result["placement"]["relayed_members_homed_near"] = homed_near(burst, fleet, opts.relays)
        result["placer_internal"] = internal_figures(metrics_before, metrics_after)
        result["cpu_s_during_burst"] = {
            k: None if v is None or (after := cpu_after[k]) is None else round(after - v, 2)
            for k, v in cpu_before.items()
        }
        result["ratios"] = ratios(result)
        result["replicas"] = {"count": opts.replicas, **await one_placement_per_job(bus, wanted)}
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

"""Relayed-path benchmark: goodput, CPU per Gbit, failover and fairness, with real processes.

    .venv/bin/python -m tests.bench.relay            # about 3 minutes
    .venv/bin/python -m tests.bench.relay --quick    # about 1 minute (smoke)

What runs (all real processes, `LocalSystem`: nats-server, the placer, the prober, two meshed
relays, one agent per fleet machine), in two systems, one after the other, in the same run.
Each job runs `sleep` as its ranks, and nothing is measured before every job is past the
prober's own probe (a short throughput sample through the same tunnels, reported as `gang`).

  cap off   a 2-machine fleet (container A, VM B, transport Auto -> Relayed), relays started
            with `--no-rate-limit`. One-way streams A -> B over four paths, in interleaved
            rounds whose order rotates:
              direct       a TCP connection from A's address straight to B's (the ceiling)
              socat        through one `socat TCP-LISTEN:..,fork,reuseaddr TCP:..` (a plain relay)
              socat_chain  through as many socat hops as the Relayed path has processes
                           (2 agents + the relays the two members are homed on)
              relayed      through agent A's SOCKS5 entry, the relays, agent B's tunnel
            Goodput (Mbit/s), CPU seconds per Gbit of the processes that carry the bytes
            (socat processes and their forked children; both agents and both relays), and
            this harness's own CPU per Gbit. Then both ways at once through the relays.
  cap on    16 machines: 8 containers + 8 VMs, each container/VM pair with an accelerator
            model only that pair has, so the 8 jobs (`members: 2`, `transport: Auto`) land on
            8 container+VM pairs, all Relayed. The relays hold each member to
            `derive(RELAYED, 2).relay_member_bits_per_second` (libs/contracts/bounds.py).
              one_gang     gang 0 alone: A -> B alone, B -> A alone, both at once, each against
                           its share (`over_share`)
              gangs        every gang streams both ways at once: aggregate goodput, per-gang
                           goodput, Jain's fairness index and min/max over the gangs, which
                           relays each gang's members are homed on
              failover     gang 0 streams both ways; the relay member A is homed on is SIGKILLed
                           mid-stream: the longest interval with no byte delivered at each
                           receiver around the kill (and the longest before it, for scale), and
                           the time from the kill until each agent's `epochs` reply names the
                           other relay (polled every POLL seconds)

Every stream is a deterministic 16 MiB pattern behind an 8-byte flow id; the receiver checks
every byte in order and counts them against what was sent (`intact`). Goodput is measured at
the receiver over a steady window (after a warm-up, until the senders stop); CPU is read from
/proc over the same window, with how busy the whole machine was and how much of that was
other programs (`others_busy_cores`: figures from a shared machine are only comparable when
it is near 0). `longest_gap_ms` is the longest interval with no byte delivered inside the
window (stalls). Through the relays, `billed_over_delivered` is what the relays metered for
the gang (the usage stream, G17: WireGuard messages members sent, acknowledgements and any
resend included) over the bytes delivered. While streaming, the harness runs at a higher
priority (nice HARNESS_NICE, when root) so the load generator is not what runs out of CPU.

Speed is reported, never asserted; stdout carries one JSON object, progress goes to stderr.
Exit status 1 means the run did not complete (a path failed, bytes were lost or corrupted,
the time budget ran out), not that it was slow. Every process the bench starts is stopped
when it ends, however it ends (and whatever the daemons started, ranks included);
`--keep-state` (or an error) keeps the state dir with the daemons' logs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import platform
import random
import shutil
import signal
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import yaml

from app.local import LocalSystem
from libs.bus.server import free_port
from libs.client.client import Client
from libs.contracts import names
from libs.contracts.bounds import derive
from libs.contracts.jobs import Job, PathClass, Phase
from libs.contracts.lifecycle import JoinedEpochsReply, JoinedEpochsRequest
from tests.factories import job
from tests.socks_client import socks_connect

PERIOD = 16 << 20  # the pattern's period: a misplaced 32 KiB link chunk cannot go unseen
CHUNK = 256 << 10
PATTERN = random.Random(20240601).randbytes(PERIOD)
CHUNKS = [PATTERN[at : at + CHUNK] for at in range(0, PERIOD, CHUNK)]
FLOW_ID = struct.Struct(">Q")
READ = 256 << 10
USAGE_FLUSH = 1.5  # relays publish usage every 100 ms; a restarted one, once it is up
POLL = 0.02  # seconds between `epochs` requests while waiting for a member to move
CLK_TCK = os.sysconf("SC_CLK_TCK")
PROBE_SAMPLE = 1.0  # seconds of the prober's throughput sample (G10.2) before measuring
# The ranks: something that runs quietly for longer than the bench, so every gang is Running
# (its epoch live) while it is measured; the agents stop it when they stop.
RANK_COMMAND = ["sleep", "3600"]
ORG = "acme"
HARNESS_NICE = -5
SETTLED = {Phase.RUNNING, Phase.SUCCEEDED, Phase.FAILED}
PAIR_HOSTS = ("127.0.4.1", "127.0.4.2")  # A (container), B (VM) of the cap-off system


def log(message: str) -> None:
    print(f"[bench.relay] {message}", file=sys.stderr, flush=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tests.bench.relay",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--seconds", type=float, default=6.0, help="length of each stream")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds before the window")
    parser.add_argument("--rounds", type=int, default=3, help="cap-off rounds of every path")
    parser.add_argument("--gangs", type=int, default=8, help="gangs of the cap-on system")
    parser.add_argument(
        "--kill-at", type=float, default=4.0, help="failover: seconds into the stream"
    )
    parser.add_argument(
        "--failover-seconds", type=float, default=10.0, help="failover: length of the stream"
    )
    parser.add_argument("--budget", type=float, default=900.0, help="the whole run, seconds")
    parser.add_argument("--keep-state", action="store_true", help="keep the state dir and logs")
    parser.add_argument("--quick", action="store_true", help="2 s streams, 1 round (smoke)")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.warmup, args.rounds = 2.0, 0.5, 1
        args.kill_at, args.failover_seconds, args.budget = 1.5, 4.0, 420.0
    return args


# -- processes ---------------------------------------------------------------------------------

_systems: list[LocalSystem] = []
_procs: list[subprocess.Popen[bytes]] = []


def cleanup() -> None:
    """Stop everything this bench started; safe to call more than once."""
    while _procs:
        proc = _procs.pop()
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
    while _systems:
        stop_system(_systems.pop())


def stop_system(system: LocalSystem) -> None:
    """`system.stop()`, then SIGKILL whatever its daemons had started (ranks, probes) and
    left behind: by pid, and only the very processes seen before the stop."""
    roots = [c.process.pid for c in system.children if c.process.poll() is None]
    spawned = [(pid, _started(pid)) for pid in _descendants(roots) if pid not in roots]
    system.stop()
    for pid, started in spawned:
        if started is not None and _started(pid) == started:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _started(pid: int) -> str | None:
    fields = _stat(pid)
    return fields[19] if fields is not None else None  # starttime: tells a reused pid apart


def spawn_socat(port: int, target: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        ["socat", f"TCP-LISTEN:{port},bind=127.0.0.1,fork,reuseaddr", target],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def machine_busy() -> float:
    """CPU seconds every CPU of this machine has spent not idle (all processes, ours too)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / CLK_TCK


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()  # fields from 3 (state) on


def _descendants(roots: list[int]) -> list[int]:
    """The roots and every live process below them (one pass over /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def cpu_seconds(groups: dict[str, list[int]], tree: bool = False) -> dict[str, float]:
    """CPU (user + system) of each group of processes; with `tree`, of their live
    descendants too (socat forks a child per connection). Cheap: it runs inside the window."""
    out: dict[str, float] = {}
    for name, roots in groups.items():
        total = 0
        for pid in _descendants(roots) if tree else roots:
            fields = _stat(pid)
            if fields is not None:
                total += int(fields[11]) + int(fields[12])
        out[name] = total / CLK_TCK
    return out


# -- streams -----------------------------------------------------------------------------------


@dataclass
class Flow:
    """One one-way stream, as its receiver saw it."""

    name: str
    sent: int = 0
    received: int = 0
    intact: bool = True
    first_bad: int | None = None
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (time, bytes so far)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def check(self, data: bytes) -> None:
        at, offset = self.received % PERIOD, 0
        while offset < len(data):
            size = min(len(data) - offset, PERIOD - at)
            if data[offset : offset + size] != PATTERN[at : at + size]:
                if self.intact:
                    self.first_bad = self.received + offset
                self.intact = False
            offset += size
            at = 0


class Sink:
    """A listener on one member's address; every connection names its flow in 8 bytes, then
    its bytes are checked and timed. Connections without a flow id (probes) are ignored."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.port = 0
        self.flows: dict[int, Flow] = {}
        self.server: asyncio.Server | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._connection, self.host, 0, limit=READ)
        self.port = self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            header = await reader.readexactly(FLOW_ID.size)
            flow = self.flows.get(FLOW_ID.unpack(header)[0])
            if flow is None:
                return
            try:
                while data := await reader.read(READ):
                    flow.check(data)
                    flow.received += len(data)
                    flow.timeline.append((time.monotonic(), flow.received))
            finally:
                flow.done.set()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


Opener = Callable[[Sink], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


@dataclass
class FlowSpec:
    name: str
    sink: Sink
    open: Opener


_flow_ids = iter(range(1, 1 << 62))


async def _send(writer: asyncio.StreamWriter, flow: Flow, until: float, drain: float) -> None:
    writer.transport.set_write_buffer_limits(high=1 << 20)
    index = 0
    while time.monotonic() < until:
        writer.write(CHUNKS[index])
        flow.sent += CHUNK
        index = (index + 1) % len(CHUNKS)
        await writer.drain()
    writer.write_eof()
    await asyncio.wait_for(flow.done.wait(), drain)
    writer.close()


@contextlib.contextmanager
def harness_priority() -> Iterator[None]:
    """While streaming, this process runs at a higher priority when allowed (root): on a small
    machine the load generator must not be what runs out of CPU. Only around the streams, so
    the daemons it starts (they inherit the priority of their parent) run at the usual one."""
    before = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, HARNESS_NICE)
    except OSError:
        yield
        return
    try:
        yield
    finally:
        os.setpriority(os.PRIO_PROCESS, 0, before)


def _can_renice() -> bool:
    with harness_priority():
        return os.getpriority(os.PRIO_PROCESS, 0) == HARNESS_NICE


async def _sleep_until(when: float) -> None:
    await asyncio.sleep(max(0.0, when - time.monotonic()))


async def stream(
    specs: list[FlowSpec],
    seconds: float,
    warmup: float,
    procs: dict[str, list[int]],
    action: Callable[[float, dict[str, Flow]], Coroutine[Any, Any, dict[str, Any]]] | None = None,
    drain: float = 60.0,
    tree: bool = False,
) -> dict[str, Any]:
    """Run the flows at once for `seconds`; goodput and CPU over [warmup, seconds]."""
    with harness_priority():
        return await _stream(specs, seconds, warmup, procs, action, drain, tree)


async def _stream(
    specs: list[FlowSpec],
    seconds: float,
    warmup: float,
    procs: dict[str, list[int]],
    action: Callable[[float, dict[str, Flow]], Coroutine[Any, Any, dict[str, Any]]] | None,
    drain: float,
    tree: bool,
) -> dict[str, Any]:
    flows: dict[str, Flow] = {}
    conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    senders: list[asyncio.Task[None]] = []
    acting: asyncio.Task[dict[str, Any]] | None = None
    try:
        for spec in specs:
            flow_id = next(_flow_ids)
            flow = Flow(spec.name)
            spec.sink.flows[flow_id] = flow
            flows[spec.name] = flow
            reader, writer = await asyncio.wait_for(spec.open(spec.sink), 30)
            writer.write(FLOW_ID.pack(flow_id))
            conns.append((reader, writer))
        t0 = time.monotonic()
        senders = [
            asyncio.create_task(_send(w, flows[s.name], t0 + seconds, drain))
            for s, (_, w) in zip(specs, conns, strict=True)
        ]
        acting = asyncio.create_task(action(t0, flows)) if action is not None else None
        # CPU first, then the clock and the counts: no byte moves here while this runs.
        await _sleep_until(t0 + warmup)
        cpu0, own0, busy0 = cpu_seconds(procs, tree), time.process_time(), machine_busy()
        start = (time.monotonic(), {n: f.received for n, f in flows.items()})
        await _sleep_until(t0 + seconds)
        cpu1, own1, busy1 = cpu_seconds(procs, tree), time.process_time(), machine_busy()
        end = (time.monotonic(), {n: f.received for n, f in flows.items()})
        await asyncio.wait_for(asyncio.gather(*senders), drain + 10)
        acted = await asyncio.wait_for(acting, 60) if acting is not None else None
    finally:
        for task in [*senders, *([acting] if acting else [])]:
            task.cancel()
        for _, writer in conns:
            writer.close()
    window = end[0] - start[0]
    delivered = {n: end[1][n] - start[1][n] for n in flows}
    gbits = sum(delivered.values()) * 8 / 1e9
    cpu = {n: round(cpu1[n] - cpu0[n], 3) for n in procs}
    result: dict[str, Any] = {
        "window_s": round(window, 3),
        "flows": {
            n: {
                "mbit_s": round(delivered[n] * 8 / window / 1e6, 1),
                "sent_bytes": f.sent,
                "received_bytes": f.received,
                "intact": f.intact and f.sent == f.received,
                "longest_gap_ms": longest_gap_ms(f, start[0], end[0]),
            }
            for n, f in flows.items()
        },
        "total_mbit_s": round(gbits * 1e3 / window, 1),
        "cpu_s": cpu,
        "cpu_s_per_gbit": round(sum(cpu.values()) / gbits, 3) if procs and gbits else None,
        "relay_cpu_s_per_gbit": per_gbit(cpu, "relay", gbits),
        "agent_cpu_s_per_gbit": per_gbit(cpu, "agent", gbits),
        "harness_cpu_s_per_gbit": round((own1 - own0) / gbits, 3) if gbits else None,
        # How busy the machine was, and how much of that was neither the measured processes
        # nor this harness (other programs on a shared machine skew every figure).
        "machine_busy_cores": round((busy1 - busy0) / window, 2),
        "others_busy_cores": round((busy1 - busy0 - sum(cpu.values()) - (own1 - own0)) / window, 2),
    }
    for name, flow in flows.items():
        if not result["flows"][name]["intact"]:
            result["flows"][name]["first_bad_offset"] = flow.first_bad
    if acted is not None:
        result["action"] = acted
    result["_flows"] = flows  # timelines, for the failover figures; dropped from the JSON
    return result


def longest_gap_ms(flow: Flow, start: float, end: float) -> float | None:
    """The longest interval with no byte delivered inside [start, end] (stalls)."""
    times = [start, *(t for t, _ in flow.timeline if start < t < end), end]
    return round(max(b - a for a, b in itertools.pairwise(times)) * 1e3, 1)


def per_gbit(cpu: dict[str, float], prefix: str, gbits: float) -> float | None:
    """CPU seconds per Gbit delivered of the processes named `prefix...` (None if none)."""
    mine = [v for n, v in cpu.items() if n.startswith(prefix)]
    return round(sum(mine) / gbits, 3) if mine and gbits else None


def rate_between(flow: Flow, start: float, end: float) -> float:
    """Mbit/s delivered between two instants, from the receiver's timeline."""
    before = max((n for t, n in flow.timeline if t <= start), default=0)
    upto = max((n for t, n in flow.timeline if t <= end), default=0)
    return round((upto - before) * 8 / (end - start) / 1e6, 1)


def all_intact(measure: dict[str, Any]) -> bool:
    return all(f["intact"] for f in measure["flows"].values())


def public(measure: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in measure.items() if not k.startswith("_")}


def jain(values: list[float]) -> float | None:
    square = sum(v * v for v in values)
    return round(sum(values) ** 2 / (len(values) * square), 4) if square else None


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


# -- the systems -------------------------------------------------------------------------------


def pair_machines(index: int, a: str, b: str, model: str) -> list[dict[str, Any]]:
    """A container-only machine and a VM with an accelerator model only they have."""
    common = {
        "region": "eu-central-1",
        "regionClass": "eu",
        "pool": f"bench-{index}",
        "cluster": "eu",
        "accelerators": {"count": 1, "backend": "cuda", "model": model},
    }
    return [
        {"name": f"vast-{index}", "provider": "vast", "offering": "container", "address": a}
        | common,
        {"name": f"lam-{index}", "provider": "lambda", "offering": "vm", "address": b} | common,
    ]


@dataclass
class Gang:
    name: str
    nodes: tuple[str, str]  # (A the container, B the VM)
    hosts: tuple[str, str]
    socks: tuple[tuple[str, int], tuple[str, int]] = (("", 0), ("", 0))
    sinks: tuple[Sink, Sink] | None = None
    homes: dict[str, str | None] = field(default_factory=dict)
    lifecycle: dict[str, Any] = field(default_factory=dict)


def lifecycle(found: Job) -> dict[str, Any]:
    """Where the job's life stood when measuring began, and the prober's own measurement of
    the pair (G11: the slowest pair of a short sample through the same path)."""
    status = found.status
    out: dict[str, Any] = {"phase": status.phase.value, "epoch": status.epoch}
    probe = status.gang.probe if status.gang else None
    if probe is not None:
        out["probe"] = {"tcp_gbps": probe.tcp_gbps, "rtt_ms": probe.rtt_ms, "path": probe.path}
    if status.phase is not Phase.RUNNING:
        out["conditions"] = [f"{c.type}={c.status}: {c.message}" for c in status.conditions]
    return out


class Bench:
    def __init__(self, args: argparse.Namespace, state: Path) -> None:
        self.args = args
        self.state = state
        self.client: Client | None = None
        self.system: LocalSystem | None = None

    async def up(
        self, name: str, gangs: int, relay_args: list[str], placer_config: Path | None = None
    ) -> list[Gang]:
        """A LocalSystem with `gangs` container+VM pairs and one Relayed job per pair; returns
        once every member's tunnel is up (its agent reports the relay it uses). `placer_config`:
        another placer config file (the stock one by default)."""
        machines: list[dict[str, Any]] = []
        plan: list[Gang] = []
        for index in range(gangs):
            hosts = (
                PAIR_HOSTS
                if gangs == 1
                else (f"127.0.5.{2 * index + 1}", f"127.0.5.{2 * index + 2}")
            )
            machines += pair_machines(index, *hosts, model=f"L4-bench-{index}")
            plan.append(Gang(f"bench-{index}", (f"vast-{index}", f"lam-{index}"), hosts))
        root = self.state / name
        root.mkdir(parents=True)
        fleet = root / "fleet.yaml"
        fleet.write_text(yaml.safe_dump({"machines": machines}))
        system = LocalSystem(
            fleet_path=fleet,
            state_dir=root / "state",
            nats_port=free_port(),
            heartbeat_seconds=1.0,
            probe_seconds=PROBE_SAMPLE,
            relay_args=relay_args,
            placer_config=placer_config,
        )
        _systems.append(system)
        self.system = system
        started = time.monotonic()
        await system.start(timeout=120)
        self.client = client = await Client.connect(system.url)
        for index, gang in enumerate(plan):
            await client.apply(
                job(
                    gang.name,
                    org=ORG,
                    accelerators={"model": f"L4-bench-{index}"},
                    distributed={"members": 2, "transport": "Auto"},
                    command=RANK_COMMAND,
                )
            )
        # The gang's life first: the prober's readiness probe and throughput sample go
        # through the same tunnels, so nothing is measured until every job is past probing.
        deadline = time.monotonic() + 180
        while True:
            jobs = [await client.get_job(g.name) for g in plan]
            homes = await self.homes([n for g in plan for n in g.nodes])
            if all(j.status.phase in SETTLED for j in jobs) and all(homes.values()):
                break
            if time.monotonic() > deadline:
                phases = {j.metadata.name: j.status.phase.value for j in jobs}
                raise RuntimeError(
                    f"gangs not probed and running within 180 s: {phases}, tunnels {homes}; "
                    f"logs in {root}"
                )
            await asyncio.sleep(0.2)
        for gang, found in zip(plan, jobs, strict=True):
            gang.lifecycle = lifecycle(found)
        await asyncio.sleep(USAGE_FLUSH)  # the probes' last bytes, metered before any measure
        records = {r.inventory.node: r for r, _, _ in await client.list_nodes()}
        for gang in plan:
            endpoints = [records[n].socks_endpoint.rpartition(":") for n in gang.nodes]
            gang.socks = (
                (endpoints[0][0], int(endpoints[0][2])),
                (endpoints[1][0], int(endpoints[1][2])),
            )
            gang.sinks = (Sink(gang.hosts[0]), Sink(gang.hosts[1]))
            for sink in gang.sinks:
                await sink.start()
            gang.homes = {n: homes[n] for n in gang.nodes}
        log(f"{name}: {gangs} Relayed gang(s) up in {time.monotonic() - started:.1f} s")
        return plan

    async def down(self) -> None:
        if self.client is not None:
            await self.client.close()
            self.client = None
        if self.system is not None:
            _systems.remove(self.system)
            stop_system(self.system)
            self.system = None

    async def joined(self, node: str) -> str | None:
        assert self.client is not None
        reply = await self.client.bus.request(
            names.node_request(node, "epochs"),
            JoinedEpochsRequest(),
            JoinedEpochsReply,
            timeout=2.0,
        )
        return reply.epochs[0].relay if reply.epochs else None

    async def homes(self, nodes: list[str]) -> dict[str, str | None]:
        found = await asyncio.gather(*(self.joined(n) for n in nodes))
        return dict(zip(nodes, found, strict=True))

    async def billed(self, gangs: list[Gang]) -> int:
        """Bytes the relays metered as sent by these gangs' members (the usage stream, G17)."""
        assert self.client is not None
        usage = await self.client.usage()
        return sum(usage.get(f"{ORG}.{g.name}", 0) for g in gangs)

    async def relayed(
        self, gangs: list[Gang], specs: list[FlowSpec], **kwargs: Any
    ) -> dict[str, Any]:
        """`stream` through the relays, plus what the relays billed the gangs for it: the
        WireGuard messages their members sent (acknowledgements, keepalives and any resend
        included) over the bytes delivered. Relays flush usage every second: this waits."""
        before = await self.billed(gangs)
        measure = await stream(specs, **kwargs)
        await asyncio.sleep(USAGE_FLUSH)
        delivered = sum(f["received_bytes"] for f in measure["flows"].values())
        billed = await self.billed(gangs) - before
        measure["billed_bytes"] = billed
        measure["billed_over_delivered"] = round(billed / delivered, 4) if delivered else None
        return measure

    def pids(self, *names_: str) -> list[int]:
        assert self.system is not None
        return [c.process.pid for c in self.system.children if c.name in names_]

    def gang_procs(self, gang: Gang) -> dict[str, list[int]]:
        procs = {f"agent-{n}": self.pids(f"agent-{n}") for n in gang.nodes}
        procs |= {r: self.pids(r) for r in ("relay-0", "relay-1")}
        return procs

    # -- openers -------------------------------------------------------------------------------

    @staticmethod
    def via_socks(socks: tuple[str, int]) -> Opener:
        async def open_(sink: Sink) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            code, reader, writer = await socks_connect(socks, sink.host, sink.port)
            if code != 0:
                writer.close()
                raise RuntimeError(f"SOCKS5 CONNECT to {sink.host}:{sink.port} refused: {code}")
            return reader, writer

        return open_

    @staticmethod
    def direct(source: str) -> Opener:
        async def open_(sink: Sink) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            return await asyncio.open_connection(
                sink.host, sink.port, local_addr=(source, 0), limit=READ
            )

        return open_

    @staticmethod
    def to(host: str, port: int) -> Opener:
        async def open_(_: Sink) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            return await asyncio.open_connection(host, port, limit=READ)

        return open_

    async def socat_chain(self, hops: int, sink: Sink) -> tuple[int, list[int]]:
        """`hops` socat relays in a row in front of `sink`; returns the first port and pids.
        Started from the last hop back, each probed before the next starts."""
        target, pids = f"TCP:{sink.host}:{sink.port}", []
        port = 0
        for _ in range(hops):
            port = free_port()
            proc = spawn_socat(port, target)
            _procs.append(proc)
            pids.append(proc.pid)
            for _attempt in range(200):
                try:
                    _, writer = await asyncio.open_connection("127.0.0.1", port)
                    writer.close()  # a probe: no flow id, the sink ignores it
                    break
                except OSError:
                    if proc.poll() is not None:
                        raise RuntimeError(f"socat exited with {proc.returncode}") from None
                    await asyncio.sleep(0.025)
            else:
                raise RuntimeError(f"socat did not listen on {port}")
            target = f"TCP:127.0.0.1:{port}"
        return port, pids

    # -- the measurements ----------------------------------------------------------------------

    async def cap_off(self) -> dict[str, Any]:
        [gang] = await self.up("cap-off", 1, ["--no-rate-limit"])
        assert gang.sinks is not None
        sink_b = gang.sinks[1]
        relays_used = len({h for h in gang.homes.values()})
        hops = 2 + relays_used
        port1, socat1 = await self.socat_chain(1, sink_b)
        port_n, socat_n = await self.socat_chain(hops, sink_b)
        await asyncio.sleep(0.2)  # let the probes' forked children exit
        paths: dict[str, tuple[Opener, dict[str, list[int]]]] = {
            "direct": (self.direct(gang.hosts[0]), {}),
            "socat": (self.to("127.0.0.1", port1), {"socat": socat1}),
            "socat_chain": (self.to("127.0.0.1", port_n), {"socat": socat_n}),
            "relayed": (self.via_socks(gang.socks[0]), self.gang_procs(gang)),
        }
        runs: dict[str, list[dict[str, Any]]] = {p: [] for p in paths}
        order = list(paths)
        for round_no in range(self.args.rounds):
            shift = round_no % len(order)
            for path in order[shift:] + order[:shift]:
                opener, procs = paths[path]
                specs = [FlowSpec("a_to_b", sink_b, opener)]
                window = {"seconds": self.args.seconds, "warmup": self.args.warmup, "procs": procs}
                if path == "relayed":
                    measure = await self.relayed([gang], specs, **window)
                else:
                    measure = await stream(specs, **window, tree=path.startswith("socat"))
                runs[path].append(public(measure))
                log(
                    f"cap off, round {round_no + 1}/{self.args.rounds}: {path} "
                    f"{measure['total_mbit_s']} Mbit/s, {measure['cpu_s_per_gbit']} CPU s/Gbit"
                )
        # Both ways at once through the relays, for the CPU of a full-duplex gang.
        assert gang.sinks is not None
        both = await self.relayed(
            [gang],
            [
                FlowSpec("a_to_b", gang.sinks[1], self.via_socks(gang.socks[0])),
                FlowSpec("b_to_a", gang.sinks[0], self.via_socks(gang.socks[1])),
            ],
            seconds=self.args.seconds,
            warmup=self.args.warmup,
            procs=self.gang_procs(gang),
        )
        log(f"cap off, relayed both ways: {both['total_mbit_s']} Mbit/s")
        out: dict[str, Any] = {
            "homes": gang.homes,
            "gang": gang.lifecycle,
            "socat_chain_hops": hops,
        }
        for path, measures in runs.items():
            rates = [m["total_mbit_s"] for m in measures]
            cpus = [m["cpu_s_per_gbit"] for m in measures if m["cpu_s_per_gbit"] is not None]
            own = [m["harness_cpu_s_per_gbit"] for m in measures if m["harness_cpu_s_per_gbit"]]
            out[path] = {
                "mbit_s_median": round(statistics.median(rates), 1),
                "mbit_s_best": max(rates),
                "mbit_s_runs": rates,
                "cpu_s_per_gbit_median": round(statistics.median(cpus), 3) if cpus else None,
                "harness_cpu_s_per_gbit_median": round(statistics.median(own), 3) if own else None,
                "cpu_s_by_process_last_run": measures[-1]["cpu_s"],
                "longest_gap_ms_max": max(m["flows"]["a_to_b"]["longest_gap_ms"] for m in measures),
                "others_busy_cores_max": max(m["others_busy_cores"] for m in measures),
                "intact": all(all_intact(m) for m in measures),
            }
            if path == "relayed":
                out[path]["relay_cpu_s_per_gbit_median"] = statistics.median(
                    m["relay_cpu_s_per_gbit"] for m in measures
                )
                out[path]["agent_cpu_s_per_gbit_median"] = statistics.median(
                    m["agent_cpu_s_per_gbit"] for m in measures
                )
                out[path]["billed_over_delivered"] = [m["billed_over_delivered"] for m in measures]
        out["relayed_both_ways"] = public(both)
        relayed, direct, socat = out["relayed"], out["direct"], out["socat"]
        out["ratios"] = {
            "relayed_over_direct": ratio(relayed["mbit_s_median"], direct["mbit_s_median"]),
            "relayed_over_socat": ratio(relayed["mbit_s_median"], socat["mbit_s_median"]),
            "relayed_over_socat_chain": ratio(
                relayed["mbit_s_median"], out["socat_chain"]["mbit_s_median"]
            ),
            "socat_over_direct": ratio(socat["mbit_s_median"], direct["mbit_s_median"]),
            "cpu_per_gbit_relayed_over_socat": ratio(
                relayed["cpu_s_per_gbit_median"], socat["cpu_s_per_gbit_median"]
            ),
            "cpu_per_gbit_relayed_over_socat_chain": ratio(
                relayed["cpu_s_per_gbit_median"], out["socat_chain"]["cpu_s_per_gbit_median"]
            ),
        }
        await self.down()
        return out

    async def cap_on(self) -> dict[str, Any]:
        gangs = await self.up("cap-on", self.args.gangs, [])
        share = derive(PathClass.RELAYED, 2).relay_member_bits_per_second / 1e6
        first = gangs[0]
        assert first.sinks is not None
        a_to_b = FlowSpec("a_to_b", first.sinks[1], self.via_socks(first.socks[0]))
        b_to_a = FlowSpec("b_to_a", first.sinks[0], self.via_socks(first.socks[1]))
        procs = self.gang_procs(first)
        seconds, warmup = self.args.seconds, self.args.warmup
        one: dict[str, Any] = {
            "homes": first.homes,
            "gang": first.lifecycle,
            "member_share_mbit_s": share,
        }
        for label, specs in (
            ("a_to_b_alone", [a_to_b]),
            ("b_to_a_alone", [b_to_a]),
            ("both_at_once", [a_to_b, b_to_a]),
        ):
            measure = public(
                await self.relayed([first], specs, seconds=seconds, warmup=warmup, procs=procs)
            )
            for flow in measure["flows"].values():
                flow["over_share"] = ratio(flow["mbit_s"], share)
            one[label] = measure
            log(f"cap on, one gang, {label}: {measure['total_mbit_s']} Mbit/s")
        result: dict[str, Any] = {"one_gang": one}

        specs = []
        for gang in gangs:
            assert gang.sinks is not None
            specs += [
                FlowSpec(f"{gang.name}/a_to_b", gang.sinks[1], self.via_socks(gang.socks[0])),
                FlowSpec(f"{gang.name}/b_to_a", gang.sinks[0], self.via_socks(gang.socks[1])),
            ]
        everyone = {c.name: [c.process.pid] for c in self.system.children} if self.system else {}
        relays_and_agents = {n: p for n, p in everyone.items() if n.startswith(("agent", "relay"))}
        many = public(
            await self.relayed(
                gangs,
                specs,
                seconds=max(seconds, 4.0),
                warmup=warmup,
                procs=relays_and_agents,
                drain=120.0,
            )
        )
        per_gang = {
            g.name: round(
                many["flows"][f"{g.name}/a_to_b"]["mbit_s"]
                + many["flows"][f"{g.name}/b_to_a"]["mbit_s"],
                1,
            )
            for g in gangs
        }
        rates = list(per_gang.values())
        cpu = many["cpu_s"]
        # Where each gang's bytes went: through one relay, or across the mesh between both.
        paths = {g.name: "+".join(sorted({str(h) for h in g.homes.values()})) for g in gangs}
        by_path: dict[str, list[float]] = {}
        for name, path in paths.items():
            by_path.setdefault(path, []).append(per_gang[name])
        homes = [h for g in gangs for h in g.homes.values()]
        result["gangs"] = {
            "gangs": len(gangs),
            "homes": {n: h for g in gangs for n, h in g.homes.items()},
            "members_per_relay": {str(h): homes.count(h) for h in sorted(set(homes), key=str)},
            "gang_relays": paths,
            "mean_gang_mbit_s_by_relays": {
                path: round(statistics.fmean(values), 1) for path, values in by_path.items()
            },
            "phases": {g.name: g.lifecycle["phase"] for g in gangs},
            "probe_tcp_gbps": {g.name: g.lifecycle.get("probe", {}).get("tcp_gbps") for g in gangs},
            "aggregate_mbit_s": many["total_mbit_s"],
            "gang_cap_mbit_s": derive(PathClass.RELAYED, 2).relay_gang_bits_per_second / 1e6,
            "per_gang_mbit_s": per_gang,
            "per_flow_mbit_s": {n: f["mbit_s"] for n, f in many["flows"].items()},
            "jain_fairness": jain(rates),
            "min_over_max": ratio(min(rates), max(rates)),
            "cpu_s": {
                "relays": round(sum(v for n, v in cpu.items() if n.startswith("relay")), 3),
                "agents": round(sum(v for n, v in cpu.items() if n.startswith("agent")), 3),
                "window_s": many["window_s"],
            },
            "cpu_s_by_relay": {n: v for n, v in cpu.items() if n.startswith("relay")},
            "cpu_s_per_gbit": many["cpu_s_per_gbit"],
            "relay_cpu_s_per_gbit": many["relay_cpu_s_per_gbit"],
            "agent_cpu_s_per_gbit": many["agent_cpu_s_per_gbit"],
            "longest_gap_ms_max": max(f["longest_gap_ms"] for f in many["flows"].values()),
            "billed_over_delivered": many["billed_over_delivered"],
            "machine_busy_cores": many["machine_busy_cores"],
            "others_busy_cores": many["others_busy_cores"],
            "intact": all_intact(many),
        }
        log(
            f"cap on, {len(gangs)} gangs: {many['total_mbit_s']} Mbit/s, "
            f"Jain {result['gangs']['jain_fairness']}"
        )
        result["failover"] = await self.failover(first, a_to_b, b_to_a)
        await self.down()
        return result

    async def failover(self, gang: Gang, a_to_b: FlowSpec, b_to_a: FlowSpec) -> dict[str, Any]:
        before = await self.homes(list(gang.nodes))
        victim = before[gang.nodes[0]]
        assert victim is not None and self.system is not None
        child = next(c for c in self.system.children if c.name == victim)

        async def kill(t0: float, _: dict[str, Flow]) -> dict[str, Any]:
            await _sleep_until(t0 + self.args.kill_at)
            killed = time.monotonic()
            os.kill(child.process.pid, signal.SIGKILL)
            moved: dict[str, float | None] = {}
            reported: dict[str, str | None] = {}
            deadline = killed + 30
            waiting = list(gang.nodes)
            while waiting and time.monotonic() < deadline:
                for node in list(waiting):
                    try:
                        home = await self.joined(node)
                    except Exception:  # the agent busy: ask again
                        continue
                    if home is not None and home != victim:
                        moved[node] = round(time.monotonic() - killed, 3)
                        reported[node] = home
                        waiting.remove(node)
                await asyncio.sleep(POLL)
            for node in waiting:
                moved[node] = None
            # Started again on its usage journal, as its supervisor (systemd, `nodus up`'s
            # caller) would: it publishes what it metered before the kill (billing.py).
            assert self.system is not None
            self.system.restart(victim)
            return {"killed_at": killed, "time_to_move_s": moved, "homes_after": reported}

        measure = await self.relayed(
            [gang],
            [a_to_b, b_to_a],
            seconds=self.args.failover_seconds,
            warmup=self.args.warmup,
            procs=self.gang_procs(gang),
            action=kill,
        )
        action = measure["action"]
        killed = action.pop("killed_at")
        flows: dict[str, Flow] = measure["_flows"]
        gaps: dict[str, Any] = {}
        t0 = killed - self.args.kill_at
        stop = t0 + self.args.failover_seconds  # the senders stop here
        for name, flow in flows.items():
            # Intervals between deliveries that overlap [kill - 0.5 s, senders stop].
            times = [t for t, _ in flow.timeline if t < stop]
            around = [
                (b - a, a) for a, b in itertools.pairwise(times) if b > killed - 0.5 and a < stop
            ]
            longest, at = max(around, default=(None, None))
            at_kill = max((n for t, n in flow.timeline if t < killed), default=0)
            after = min(1.0, stop - killed)
            gaps[name] = {
                "longest_gap_ms": round(longest * 1e3, 1) if longest is not None else None,
                "gap_started_after_kill_ms": round((at - killed) * 1e3, 1)
                if at is not None
                else None,
                "longest_gap_before_kill_ms": longest_gap_ms(flow, t0 + self.args.warmup, killed),
                "mbit_s_1s_before_kill": rate_between(flow, killed - 1.0, killed),
                "mbit_s_after_kill": rate_between(flow, killed, killed + after),
                "after_kill_window_s": round(after, 3),
                "bytes_after_kill": flow.received - at_kill,
                "intact": flow.intact and flow.sent == flow.received,
            }
        return {
            "killed": victim,
            "homes_before": before,
            **action,
            "delivery": gaps,
            "mbit_s_over_stream": {n: f["mbit_s"] for n, f in measure["flows"].items()},
            # The killed relay's counts survive in its usage journal and are published when
            # it starts again (billing.py); resends through the other relay add.
            "billed_over_delivered": measure["billed_over_delivered"],
            "killed_relay_restarted": True,
            "others_busy_cores": measure["others_busy_cores"],
            "intact": all_intact(measure),
        }


def completed(result: dict[str, Any]) -> bool:
    """Every part ran and every byte arrived intact."""
    if "error" in result:
        return False
    off, on = result.get("cap_off", {}), result.get("cap_on", {})
    checks = [off.get(p, {}).get("intact") for p in ("direct", "socat", "socat_chain", "relayed")]
    checks.append(all_intact(off["relayed_both_ways"]) if "relayed_both_ways" in off else None)
    one = on.get("one_gang", {})
    checks += [
        all_intact(one[k]) if k in one else None
        for k in ("a_to_b_alone", "b_to_a_alone", "both_at_once")
    ]
    checks += [on.get("gangs", {}).get("intact"), on.get("failover", {}).get("intact")]
    return all(c is True for c in checks)


async def run_async(args: argparse.Namespace, state: Path) -> dict[str, Any]:
    bounds = derive(PathClass.RELAYED, 2)
    result: dict[str, Any] = {
        "params": {
            "stream_seconds": args.seconds,
            "warmup_seconds": args.warmup,
            "cap_off_rounds": args.rounds,
            "gangs": args.gangs,
            "failover_stream_seconds": args.failover_seconds,
            "kill_at_seconds": args.kill_at,
            "epochs_poll_seconds": POLL,
        },
        "machine": {
            "cpus": os.cpu_count(),
            "kernel": platform.release(),
            "python": platform.python_version(),
            "socat": (shutil.which("socat") or "missing"),
            "loadavg_at_start": os.getloadavg(),
        },
        "bounds": {
            "gang_mbit_s": bounds.relay_gang_bits_per_second / 1e6,
            "member_mbit_s": bounds.relay_member_bits_per_second / 1e6,
            "tunnel_buffer_bytes": bounds.tunnel_buffer_bytes,
        },
    }
    bench = Bench(args, state)
    try:
        result["cap_off"] = await bench.cap_off()
        result["cap_on"] = await bench.cap_on()
    finally:
        await bench.down()
        result["machine"]["loadavg_at_end"] = os.getloadavg()
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    if shutil.which("socat") is None:
        return {"error": "socat is not installed (Debian socat; make system-deps)"}
    state = Path(tempfile.mkdtemp(prefix="nodus-bench-relay-"))
    result: dict[str, Any] = {}
    started = time.monotonic()
    try:
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            result = runner.run(asyncio.wait_for(run_async(args, state), args.budget))
    except TimeoutError:
        result = {"error": f"the run did not finish within its budget of {args.budget:g} s"}
    except Exception as error:
        result = {"error": f"{type(error).__name__}: {error}"}
    finally:
        cleanup()
    result["elapsed_s"] = round(time.monotonic() - started, 1)
    result["harness_nice_while_streaming"] = HARNESS_NICE if _can_renice() else 0
    result["intact"] = completed(result)
    if not result["intact"] and "error" not in result:
        result["error"] = "bytes were lost or corrupted (see the flows marked intact: false)"
    if args.keep_state or "error" in result:
        result["state_dir"] = str(state)
    else:
        shutil.rmtree(state, ignore_errors=True)
    return result


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop when it is there, like the daemons: the harness should cost as little as it can."""
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


def _terminate(signum: int, _: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Sequence[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _terminate)
    try:
        result = run(parse_args(argv))
    finally:
        cleanup()
    print(json.dumps(result, indent=2))
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())

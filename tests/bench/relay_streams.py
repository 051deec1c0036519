"""The Relayed-path bench's measuring harness: deterministic one-way streams behind an 8-byte
flow id, a sink that checks every byte in order and times it, and the figures of a window
(goodput, CPU per Gbit of the processes that carry the bytes, this harness's own CPU, how busy
the machine was, the longest stall). Used by tests/bench/relay.py and its scenarios."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import random
import struct
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any

from tests.bench.running import sleep_until
from tests.bench.sampling import cpu_seconds, machine_busy

PERIOD = 16 << 20  # the pattern's period: a misplaced 32 KiB link chunk cannot go unseen
CHUNK = 256 << 10
PATTERN = random.Random(20240601).randbytes(PERIOD)
CHUNKS = [PATTERN[at : at + CHUNK] for at in range(0, PERIOD, CHUNK)]
FLOW_ID = struct.Struct(">Q")
READ = 256 << 10
HARNESS_NICE = -5


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


def can_renice() -> bool:
    with harness_priority():
        return os.getpriority(os.PRIO_PROCESS, 0) == HARNESS_NICE


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
        await sleep_until(t0 + warmup)
        cpu0, own0, busy0 = cpu_seconds(procs, tree), time.process_time(), machine_busy()
        start = (time.monotonic(), {n: f.received for n, f in flows.items()})
        await sleep_until(t0 + seconds)
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

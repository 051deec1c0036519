"""Slow-receiver bench: does a member that stops reading slow any OTHER gang on the same relays?

    .venv/bin/python -m tests.bench.slow_receiver            # about 80 s
    .venv/bin/python -m tests.bench.slow_receiver --quick    # about 25 s (smoke)

What runs, in this one process on a real nats-server (no agents, no WireGuard): two meshed
`Relay`s (services/relay/relay.py) on 127.0.0.1 and four `RelayClient`s (the member's client:
libs/relayproto/client.py, services/agent/relayclient.py before issue 9) as members, with the
membership records the relays read (epoch and member records in KV, as the placer and the
agents write them). The homes force every byte across the one mesh link relay-0 -> relay-1:

    gang 1   A1 on relay-0 only  ->  B1 on relay-1 only  (B1 through a local pipe that can stall)
    gang 2   A2 on relay-0 only  ->  B2 on relay-1 only  (the gang whose goodput is measured)

Each sender streams WireGuard-shaped transport messages (type 4, a 16-byte header whose
counter is the message's sequence number, a MESSAGE-byte body, a 16-byte tag: what the relay
forwards, see libs/wg message_type) as fast as its relay connection takes them (it waits on
the connection's write buffer above 1 MiB). Gang 2 streams throughout; the phases are

    alone           gang 1 idle
    shared          A1 streams to B1 too, B1 reading: the unstalled figure
    slow            B1 reads only TRICKLE bytes/s of what relay-1 sends it (a receiver that
                    falls behind but still hears its relay); A1 keeps sending to it
    recovered_slow  B1 reads at full speed again
    stalled         B1 stops reading (its pipe stops reading the relay's socket, so relay-1
                    sees a member whose TCP window closes); A1 keeps sending to it
    recovered       B1 reads again (and rejoins relay-1 if its connection ended meanwhile: a
                    client that hears nothing from its relay may give up on it)

Per phase, over the phase minus its first SETTLE seconds: each gang's goodput at its receiver
(Mbit/s of WireGuard messages delivered), gang 2's longest interval without a delivery, gang
2's goodput in every half second of the whole phase (when a stall bites, when it recovers),
this process's CPU and the machine's, with how busy other programs kept it
(`others_busy_cores`: figures from a shared machine are only comparable when it is near 0),
and how the relays' counters (nodus_relay_*_total, drops by reason included) moved. Over the
run: lost or reordered messages per gang (sequence numbers), the time from each resume to
gang 2's next delivery, every member connection that ended (in which phase, and why when the
client says), and the warnings and errors logged in this process (relays, clients, asyncio).

Two configurations, each on fresh relays and fresh gangs: `capped`, the relays as deployed,
holding each member to its share (derive(RELAYED, 2).relay_member_bits_per_second), and
`uncapped` (rate_limit=False: what the process can push; the gangs then share its CPU, so
`shared` is below `alone`). `summary` carries the ratios: `stalled_over_unstalled` is gang 2's
goodput while B1 is stalled over its goodput with both gangs streaming and B1 reading (1.0:
no harm; near 0: head-of-line blocking on the mesh link), `slow_over_unstalled` the same for
the slow receiver, `recovered_over_unstalled` whether it comes back.

Speed is reported, never asserted; stdout carries one JSON object, progress goes to stderr.
Exit status 1 means the run did not complete (setup failed, the budget ran out), not that a
gang was slow. Everything it starts (nats-server, relays, clients, pipes) is stopped when it
ends, however it ends; `--keep-state` keeps nats-server's directory.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import importlib
import itertools
import json
import logging
import os
import platform
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import REGISTRY

from libs.bus import Bus
from libs.bus.server import NatsServer, free_port
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.bounds import derive
from libs.contracts.epochs import Epoch, EpochMember
from libs.contracts.jobs import PathClass
from libs.contracts.relay import Member
from libs.relayproto import x25519_public
from libs.wg.messages import TRANSPORT_HEADER
from services.relay.relay import Relay
from tests.bench.relay import _sleep_until, machine_busy, ratio
from tests.bench.running import run_bench, terminate

if TYPE_CHECKING:
    from libs.relayproto.client import RelayClient

ORG = "acme"
PHASES = ("alone", "shared", "slow", "recovered_slow", "stalled", "recovered")
TAG = bytes(16)
PACE_BYTES = 1 << 20  # a sender waits for its relay connection above this much queued
BATCH = 8  # messages queued between two looks at the connection's buffer
PIPE_READ = 256 << 10
TRICKLE_TICK = 0.1  # seconds between a slowed receiver's reads


def log(message: str) -> None:
    print(f"[bench.slow_receiver] {message}", file=sys.stderr, flush=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tests.bench.slow_receiver",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--phase", type=float, default=5.0, help="seconds of each phase")
    parser.add_argument(
        "--settle", type=float, default=1.0, help="seconds at the start of a phase not measured"
    )
    parser.add_argument(
        "--message",
        type=int,
        default=32 << 10,
        help="bytes of each message's body (the link's chunk)",
    )
    parser.add_argument(
        "--trickle",
        type=float,
        default=64 << 10,
        help="bytes/s the slow receiver reads in the `slow` phase",
    )
    parser.add_argument(
        "--configs",
        default="capped,uncapped",
        help="comma-separated: capped (relays as deployed), uncapped (rate_limit=False)",
    )
    parser.add_argument("--budget", type=float, default=300.0, help="the whole run, seconds")
    parser.add_argument("--keep-state", action="store_true", help="keep nats-server's directory")
    parser.add_argument("--quick", action="store_true", help="1.5 s phases (smoke)")
    args = parser.parse_args(argv)
    if args.quick:
        args.phase, args.settle, args.budget = 1.5, 0.5, 120.0
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = set(args.configs) - {"capped", "uncapped"}
    if unknown or not args.configs:
        parser.error(f"unknown configs: {sorted(unknown)}")
    if args.message % 16 or args.message < 16:
        parser.error("--message must be a positive multiple of 16 (WireGuard pads to 16)")
    return args


# -- members -----------------------------------------------------------------------------------


def relay_client_class() -> type[RelayClient]:
    """The member's client: libs/relayproto/client.py since issue 9, services/agent/
    relayclient.py before it (so the bench runs on both, for figures to compare)."""
    try:
        module = importlib.import_module("libs.relayproto.client")
    except ModuleNotFoundError:
        module = importlib.import_module("services.agent.relayclient")
    found: type[RelayClient] = module.RelayClient
    return found


@dataclass
class Flow:
    """One gang's one-way stream, as its receiver saw it."""

    name: str
    received: int = 0
    messages: int = 0
    last_seq: int = 0
    lost: int = 0  # sequence numbers skipped
    reordered: int = 0  # sequence numbers at or below one already seen
    sent_messages: int = 0
    refused_sends: int = 0  # send_now said the relay connection was down
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (time, bytes so far)
    losses: list[tuple[float, int]] = field(default_factory=list)  # (time, messages skipped)

    def deliver(self, message: bytes) -> None:
        seq = int.from_bytes(message[8:16], "little")
        if seq > self.last_seq + 1:
            self.lost += seq - self.last_seq - 1
            self.losses.append((time.monotonic(), seq - self.last_seq - 1))
        elif seq <= self.last_seq:
            self.reordered += 1
        self.last_seq = max(self.last_seq, seq)
        self.received += len(message)
        self.messages += 1
        self.timeline.append((time.monotonic(), self.received))

    def at(self, when: float) -> int:
        """Bytes delivered by `when` (the timeline is in time order)."""
        lo, hi = 0, len(self.timeline)
        while lo < hi:
            mid = (lo + hi) // 2
            if self.timeline[mid][0] <= when:
                lo = mid + 1
            else:
                hi = mid
        return self.timeline[lo - 1][1] if lo else 0

    def lost_between(self, start: float, end: float) -> int:
        return sum(n for t, n in self.losses if start <= t < end)

    def first_after(self, when: float) -> float | None:
        return next((t for t, _ in self.timeline if t > when), None)

    def rates(self, start: float, end: float, step: float) -> list[float]:
        """Mbit/s in each `step` seconds from `start` to `end`."""
        out, at = [], start
        while at + step <= end + 1e-9:
            out.append(round((self.at(at + step) - self.at(at)) * 8 / step / 1e6, 1))
            at += step
        return out

    def longest_gap_ms(self, start: float, end: float) -> float:
        times = [start, *(t for t, _ in self.timeline if start < t < end), end]
        return round(max(b - a for a, b in itertools.pairwise(times)) * 1e3, 1)


class Node:
    """One gang member: its WireGuard key pair and, once connected, its relay client."""

    def __init__(self, gang: str, name: str, rank: int) -> None:
        self.gang, self.name, self.rank = gang, name, rank
        self.private = os.urandom(32)
        self.public = x25519_public(self.private)
        self.client: RelayClient | None = None
        self.task: asyncio.Task[None] | None = None
        self.on_message: Callable[[bytes, bytes], None] = lambda src, msg: None

    async def connect(self, relay: Relay, address: str | None = None, timeout: float = 10) -> None:
        """Connect until the relay knows this member (it reads the records from KV)."""
        deadline = time.monotonic() + timeout
        while True:
            client = relay_client_class()(
                relay.name,
                address or relay.address,
                self.gang,
                1,
                self.name,
                self.private,
                self.public,
                lambda src, msg: self.on_message(src, msg),
            )
            try:
                await client.connect()
                break
            except Exception as error:  # NotAMember until the relay has read the records
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{self.name} could not join {relay.name}: {error}"
                    ) from error
                await asyncio.sleep(0.05)
        self.client = client
        self.task = asyncio.get_running_loop().create_task(client.run())

    @property
    def up(self) -> bool:
        return self.client is not None and self.client.up and not (self.task and self.task.done())

    def ended(self) -> str | None:
        """Why the client's connection ended, when the client says (newer clients do)."""
        why = getattr(self.client, "ended", None)
        return str(why) if why else None

    def close(self) -> None:
        if self.client is not None:
            self.client.close()


async def enrol(bus: Bus, gang: str, members: list[Node]) -> None:
    """The records the relays authenticate by: the epoch, and each member's WireGuard key."""
    t = now()
    await bus.bucket(names.BUCKET_EPOCHS, Epoch).put(
        names.epoch_key(gang, 1),
        Epoch(
            gang=gang,
            epoch=1,
            path=PathClass.RELAYED,
            mesh_id=os.urandom(16).hex(),
            verify_key="bench",
            members=[
                EpochMember(
                    rank=m.rank,
                    node=m.name,
                    address=f"10.0.0.{m.rank + 1}",
                    interface="eth0",
                    devices=[],
                    env={},
                )
                for m in members
            ],
            bounds=derive(PathClass.RELAYED, len(members)),
            created_time=t,
            join_keys_expire_time=t + timedelta(minutes=15),
            placed_by="bench",
        ),
    )
    for m in members:
        await bus.bucket(names.BUCKET_MEMBERS, Member).put(
            names.member_key(gang, 1, m.name),
            Member(
                gang=gang,
                epoch=1,
                node=m.name,
                rank=m.rank,
                address=f"10.0.0.{m.rank + 1}",
                wg_public_key=base64.b64encode(m.public).decode(),
                joined_time=t,
            ),
        )


def transport(seq: int, body: bytes) -> bytes:
    """A WireGuard transport message: type 4, receiver 0, counter `seq`, body, tag."""
    return TRANSPORT_HEADER.pack(4, 0, seq) + body + TAG


class Sender:
    """A member streaming to its peer as fast as its relay connection takes the messages."""

    def __init__(self, member: Node, dst: bytes, flow: Flow, body: int) -> None:
        self.member, self.dst, self.flow = member, dst, flow
        self.body = bytes(body)
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task

    async def _run(self) -> None:
        client = self.member.client
        assert client is not None
        flow = self.flow
        while True:
            for _ in range(BATCH):
                if client.send_now(self.dst, transport(flow.sent_messages + 1, self.body)):
                    flow.sent_messages += 1
                else:
                    flow.refused_sends += 1
                    await asyncio.sleep(0.01)
                    break
            await pace(client)


async def pace(client: RelayClient) -> None:
    """Wait while the relay connection holds more than PACE_BYTES (the relay is not reading),
    else just let the loop run. The one place that knows how a client says it is full."""
    if client.backlog() > PACE_BYTES:
        await client.drain()
    else:
        await asyncio.sleep(0)


class StallPipe:
    """A local TCP pipe between one member and its relay that can stop reading the relay's
    side, or read it at a trickle: the relay then sees a member that stopped reading (its TCP
    window closes) or reads slowly, while the member's own client is unchanged (what it
    sends still goes up at once). Listens on 127.0.0.1."""

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host.strip("[]"), int(port))
        self.reading = asyncio.Event()
        self.reading.set()
        self.rate = 0.0  # bytes/s read from the relay's side while slowed; 0: as fast as it can
        self.server: asyncio.Server | None = None
        self.tasks: set[asyncio.Task[None]] = set()
        self.writers: list[asyncio.StreamWriter] = []
        self.address = ""

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._accept, "127.0.0.1", 0, limit=PIPE_READ)
        self.address = f"127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    def stall(self) -> None:
        self.reading.clear()

    def slow(self, rate: float) -> None:
        self.rate = rate
        self.reading.set()

    def resume(self) -> None:
        self.rate = 0.0
        self.reading.set()

    async def stop(self) -> None:
        self.reading.set()
        if self.server is not None:
            self.server.close()
        for writer in self.writers:
            writer.close()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target, limit=PIPE_READ)
        self.writers += [writer, up_writer]
        loop = asyncio.get_running_loop()
        for task in (
            loop.create_task(self._copy(reader, up_writer, None)),
            loop.create_task(self._copy(up_reader, writer, self)),
        ):
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    @staticmethod
    async def _copy(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, gate: StallPipe | None
    ) -> None:
        try:
            while True:
                rate = 0.0
                if gate is not None:
                    await gate.reading.wait()  # stalled: the reader's buffer fills, unread
                    rate = gate.rate
                size = PIPE_READ if not rate else max(1, int(rate * TRICKLE_TICK))
                data = await reader.read(size)
                if not data:
                    break
                writer.write(data)
                await writer.drain()
                if rate:
                    await asyncio.sleep(len(data) / rate)
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()


# -- measuring ---------------------------------------------------------------------------------


def relay_counters() -> dict[str, float]:
    """Every nodus_relay_*_total sample of this process, by name and labels."""
    out: dict[str, float] = {}
    for metric in REGISTRY.collect():
        if not metric.name.startswith("nodus_relay"):
            continue
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


def moved(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {
        k: round(v - before.get(k, 0.0), 1) for k, v in sorted(after.items()) if v != before.get(k)
    }


class LogTally(logging.Handler):
    """Warnings and errors logged in this process (the relays', the clients', asyncio's)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.counts: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        text = f"{record.levelname} {record.name}: {record.getMessage()}"[:300]
        if record.exc_info:
            text += " (with a traceback)"
        self.counts[text] = self.counts.get(text, 0) + 1

    def take(self) -> dict[str, int]:
        out, self.counts = self.counts, {}
        return out


@dataclass
class Mark:
    at: float
    cpu: float
    busy: float
    counters: dict[str, float]


def mark() -> Mark:
    return Mark(time.monotonic(), time.process_time(), machine_busy(), relay_counters())


def nats_cpu(server: NatsServer) -> float:
    if server.process is None:
        return 0.0
    try:
        text = Path(f"/proc/{server.process.pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- the experiment ----------------------------------------------------------------------------


class Experiment:
    def __init__(self, args: argparse.Namespace, bus: Bus, nats: NatsServer) -> None:
        self.args = args
        self.bus = bus
        self.nats = nats
        self.relays: list[Relay] = []
        self.members: list[Node] = []
        self.senders: list[Sender] = []
        self.pipes: list[StallPipe] = []

    async def close(self) -> None:
        for sender in self.senders:
            await sender.stop()
        for member in self.members:
            member.close()
        tasks = [m.task for m in self.members if m.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for pipe in self.pipes:
            await pipe.stop()
        for relay in self.relays:
            try:
                await asyncio.wait_for(relay.stop(), 10)
            except (TimeoutError, Exception) as error:  # report, and stop the others
                log(f"{relay.name} did not stop cleanly: {type(error).__name__}: {error}")
        self.senders, self.members, self.pipes, self.relays = [], [], [], []

    async def run(self, config: str, tally: LogTally) -> dict[str, Any]:
        rate_limit = config == "capped"
        mesh_key = os.urandom(32)
        ports = [free_port(), free_port()]
        self.relays = [
            Relay(
                self.bus,
                f"relay-{i}",
                "eu" if i == 0 else "us",
                ("127.0.0.1", ports[i]),
                [f"127.0.0.1:{ports[1 - i]}"],
                mesh_key,
                rate_limit=rate_limit,
            )
            for i in range(2)
        ]
        for relay in self.relays:
            await relay.start()
        relay0, relay1 = self.relays
        gang1, gang2 = f"{ORG}.slow1-{config}", f"{ORG}.slow2-{config}"
        a1, b1 = Node(gang1, "a1", 0), Node(gang1, "b1", 1)
        a2, b2 = Node(gang2, "a2", 0), Node(gang2, "b2", 1)
        self.members = [a1, b1, a2, b2]
        await enrol(self.bus, gang1, [a1, b1])
        await enrol(self.bus, gang2, [a2, b2])
        flows = {"gang1": Flow("gang1"), "gang2": Flow("gang2")}
        b1.on_message = lambda src, msg: flows["gang1"].deliver(msg)
        b2.on_message = lambda src, msg: flows["gang2"].deliver(msg)
        pipe = StallPipe(relay1.address)
        await pipe.start()
        self.pipes = [pipe]
        await a1.connect(relay0)
        await a2.connect(relay0)
        await b1.connect(relay1, address=pipe.address)
        await b2.connect(relay1)
        await self.reach(a1, b1, flows["gang1"])
        await self.reach(a2, b2, flows["gang2"])
        log(f"{config}: two gangs across the mesh, relays up")

        body = self.args.message
        sender1 = Sender(a1, b1.public, flows["gang1"], body)
        sender2 = Sender(a2, b2.public, flows["gang2"], body)
        self.senders = [sender2, sender1]
        tally.take()
        phase = self.args.phase
        marks: dict[str, tuple[Mark, Mark]] = {}
        starts: dict[str, float] = {}
        nats_at: dict[str, tuple[float, float]] = {}
        events: list[dict[str, Any]] = []
        current = ["alone"]
        watching = asyncio.get_running_loop().create_task(
            watch(self.members, events, current, starts)
        )
        reconnected: list[str] = []
        sender2.start()
        try:
            for name in PHASES:
                current[0] = name
                if name == "shared":
                    sender1.start()
                elif name == "slow":
                    pipe.slow(self.args.trickle)
                elif name == "stalled":
                    pipe.stall()
                elif name.startswith("recovered"):
                    pipe.resume()
                    if not b1.up:  # its own client gave up on the silent relay: rejoin
                        await b1.connect(relay1, address=pipe.address)
                        reconnected.append(name)
                starts[name] = time.monotonic()
                await asyncio.sleep(self.args.settle)
                first, n0 = mark(), nats_cpu(self.nats)
                await _sleep_until(starts[name] + phase)
                marks[name] = (first, mark())
                nats_at[name] = (n0, nats_cpu(self.nats))
                log(f"{config}: {name}: gang 2 {rate(flows['gang2'], *marks[name]):.1f} Mbit/s")
        finally:
            watching.cancel()
        end = time.monotonic()
        connected = {m.name: m.up for m in self.members}
        ended = {m.name: m.ended() for m in self.members if not m.up}
        logs = tally.take()
        await self.close()

        phases: dict[str, Any] = {}
        for name, (m0, m1) in marks.items():
            window = m1.at - m0.at
            own = m1.cpu - m0.cpu
            nats = nats_at[name][1] - nats_at[name][0]
            g2 = flows["gang2"]
            phases[name] = {
                "window_s": round(window, 3),
                "gang2_mbit_s": round(rate(g2, m0, m1), 1),
                "gang1_mbit_s": round(rate(flows["gang1"], m0, m1), 1),
                "gang2_longest_gap_ms": g2.longest_gap_ms(m0.at, m1.at),
                # Messages skipped (dropped on the way) in the whole phase, settling included.
                "gang2_lost_messages": g2.lost_between(starts[name], m1.at),
                "gang1_lost_messages": flows["gang1"].lost_between(starts[name], m1.at),
                "gang2_longest_gap_ms_whole_phase": g2.longest_gap_ms(starts[name], m1.at),
                # The whole phase, settling included, in half seconds: when a stall bites.
                "gang2_mbit_s_by_half_second": g2.rates(starts[name], m1.at, 0.5),
                "process_busy_cores": round(own / window, 2),
                "machine_busy_cores": round((m1.busy - m0.busy) / window, 2),
                "others_busy_cores": round((m1.busy - m0.busy - own - nats) / window, 2),
                "relay_counters_moved": moved(m0.counters, m1.counters),
            }
        unstalled = phases["shared"]["gang2_mbit_s"]
        share = derive(PathClass.RELAYED, 2).relay_member_bits_per_second / 1e6

        def over(phase_name: str, base: float) -> float | None:
            return ratio(phases[phase_name]["gang2_mbit_s"], base)

        after_resume: dict[str, Any] = {}
        for name in ("recovered_slow", "recovered"):
            resume = starts[name]
            resumed = flows["gang2"].first_after(resume)
            until = starts.get("stalled", end) if name == "recovered_slow" else end
            got = flows["gang1"].at(until) - flows["gang1"].at(resume)
            after_resume[name] = {
                "gang2_first_delivery_ms": round((resumed - resume) * 1e3, 1)
                if resumed is not None
                else None,
                "gang1_mbit_s": round(got * 8 / (until - resume) / 1e6, 1),
                "b1_rejoined": name in reconnected,
            }
        result: dict[str, Any] = {
            "rate_limit": rate_limit,
            "member_share_mbit_s": share if rate_limit else None,
            "message_bytes": len(transport(0, bytes(body))),
            "slow_receiver_bytes_s": self.args.trickle,
            "phases": phases,
            "ratios": {
                "stalled_over_unstalled": over("stalled", unstalled),
                "slow_over_unstalled": over("slow", unstalled),
                "recovered_over_unstalled": over("recovered", unstalled),
                "recovered_slow_over_unstalled": over("recovered_slow", unstalled),
                "stalled_over_alone": over("stalled", phases["alone"]["gang2_mbit_s"]),
                "shared_over_alone": ratio(unstalled, phases["alone"]["gang2_mbit_s"]),
            },
            "after_resume": after_resume,
            "flows": {
                name: {
                    "sent_messages": f.sent_messages,
                    "delivered_messages": f.messages,
                    "lost_messages": f.lost,
                    "reordered_messages": f.reordered,
                    "refused_sends": f.refused_sends,
                }
                for name, f in flows.items()
            },
            "connections_ended": events,
            "connected_at_end": connected,
            "ended_at_end": ended,
            "log_warnings": logs,
        }
        return result

    @staticmethod
    async def reach(src: Node, dst: Node, flow: Flow, timeout: float = 15) -> None:
        """Until one message from src reaches dst: sessions, mesh links and presence are up.
        The probes' sequence numbers are 0, so the stream's own count starts clean."""
        assert src.client is not None
        deadline = time.monotonic() + timeout
        before = flow.messages
        while flow.messages == before:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{src.name} never reached {dst.name} across the mesh")
            src.client.send_now(dst.public, transport(0, bytes(16)))
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)  # stragglers of the probe
        flow.received, flow.messages, flow.last_seq, flow.reordered, flow.lost = 0, 0, 0, 0, 0
        flow.timeline.clear()
        flow.losses.clear()


async def watch(
    members: list[Node], events: list[dict[str, Any]], phase: list[str], starts: dict[str, float]
) -> None:
    """Note when a member's relay connection ends (and why, if its client says), and in
    which phase: a relay or a client may close a member that stopped reading."""
    seen: set[int] = set()
    while True:
        for member in members:
            client = member.client
            if client is not None and id(client) not in seen and not member.up:
                seen.add(id(client))
                name = phase[0]
                events.append(
                    {
                        "member": member.name,
                        "phase": name,
                        "s_into_phase": round(time.monotonic() - starts.get(name, 0.0), 2)
                        if name in starts
                        else None,
                        "why": member.ended(),
                    }
                )
        await asyncio.sleep(0.02)


def rate(flow: Flow, m0: Mark, m1: Mark) -> float:
    return (flow.at(m1.at) - flow.at(m0.at)) * 8 / (m1.at - m0.at) / 1e6


async def run_async(args: argparse.Namespace, state: Path) -> dict[str, Any]:
    result: dict[str, Any] = {
        "params": {
            "phase_seconds": args.phase,
            "settle_seconds": args.settle,
            "message_body_bytes": args.message,
            "slow_receiver_bytes_s": args.trickle,
            "configs": args.configs,
            "phases": list(PHASES),
        },
        "machine": {
            "cpus": os.cpu_count(),
            "kernel": platform.release(),
            "python": platform.python_version(),
            "loadavg_at_start": os.getloadavg(),
        },
        "topology": {
            "gang1": "A1 on relay-0 -> B1 on relay-1 (B1 stalls)",
            "gang2": "A2 on relay-0 -> B2 on relay-1 (measured)",
            "mesh": "every byte crosses the relay-0 -> relay-1 link",
        },
        "configs": {},
    }
    tally = LogTally()
    logging.getLogger().addHandler(tally)
    nats = NatsServer(state / "nats")
    _servers.append(nats)
    bus: Bus | None = None
    experiment: Experiment | None = None
    try:
        nats.start()
        bus = await Bus.open(nats.url, name="bench", buckets=names.ALL_BUCKETS, streams=True)
        experiment = Experiment(args, bus, nats)
        for config in args.configs:
            result["configs"][config] = await experiment.run(config, tally)
    finally:
        if experiment is not None:
            await experiment.close()
        if bus is not None:
            await bus.close()
        nats.stop()
        logging.getLogger().removeHandler(tally)
        result["machine"]["loadavg_at_end"] = os.getloadavg()
    result["summary"] = {
        config: {
            **c["ratios"],
            "gang2_mbit_s": {p: c["phases"][p]["gang2_mbit_s"] for p in PHASES},
            "gang2_lost_messages": c["flows"]["gang2"]["lost_messages"],
            "connections_ended": c["connections_ended"],
            "others_busy_cores_max": max(c["phases"][p]["others_busy_cores"] for p in PHASES),
        }
        for config, c in result["configs"].items()
    }
    return result


_servers: list[NatsServer] = []


def cleanup() -> None:
    """Stop the nats-server this bench started, however the run ended; safe to call twice."""
    while _servers:
        _servers.pop().stop()


def run(args: argparse.Namespace) -> dict[str, Any]:
    return run_bench("nodus-bench-slow-", lambda state: run_async(args, state), args, cleanup)


def main(argv: Sequence[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, terminate)
    result = run(parse_args(argv))
    print(json.dumps(result, indent=2))
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())

"""The slow-receiver bench's experiment: one configuration on fresh relays and fresh gangs,
through every phase, and what each phase measured (goodput per gang, stalls, CPU, the relays'
counters, the warnings logged). See tests/bench/slow_receiver.py."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import REGISTRY

from libs.bus import Bus
from libs.bus.server import NatsServer, free_port
from libs.contracts.bounds import derive
from libs.contracts.jobs import PathClass
from services.relay.relay import Relay
from tests.bench.relay_streams import ratio
from tests.bench.running import progress, sleep_until
from tests.bench.sampling import machine_busy, process_cpu
from tests.bench.slow_receiver_members import Flow, Node, Sender, StallPipe, enrol, transport

ORG = "acme"
PHASES = ("alone", "shared", "slow", "recovered_slow", "stalled", "recovered")

log = progress("slow_receiver")

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
    return process_cpu(server.process.pid) or 0.0


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
                await sleep_until(starts[name] + phase)
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

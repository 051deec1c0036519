"""Relayed gangs of 2, 4 and 8 members (issue 26): the probe, the gang's rate shared, a relay
killed under every member's stream.

    .venv/bin/python -m tests.bench.relayed_gang            # 2, 4 and 8 members
    .venv/bin/python -m tests.bench.relayed_gang --quick    # 2 and 4 members, 2-s streams

For each size N, a system of its own (`LocalSystem`: nats-server, placer, runner, two meshed
relays, N machines on loopback, containers and VMs alternating, so the gang is Relayed) and
one N-member job (`sleep`). A gang of more than 2 needs a qualification: with `--qualify`,
`nodus qualify --path relayed --members N` measures one first (its figures reported), else the
placer's `relayedMaxMembers` is raised to N (the operator's override). Then:

1. probe: apply -> Running, and the probe record's wall time (the runner measures every pair in
   N/2 rounds of full-duplex pairs, each a `--sample-seconds` sample) and rounds' time from the
   last member's join; `overRoundsTimesSample` is what the issue's goal (rounds x sample + 3 s)
   is about.
2. ring: every member sends to the next at once (iperf3 through the shim, `--seconds`): each
   member's goodput against its share of the gang's 1 Gbit/s (G18), Jain's index over the
   members, the gang's total, and each member's bill against what its program sent.
3. failover (sizes in `--failover`, default 8): every member streams to the next (a sender
   through the shim, a receiver on the next member's address timing each arrival); the relay
   most members send through is SIGKILLed; each receiver's longest gap, bytes intact, and how
   many members moved.

Speed is reported, never asserted; stdout carries one JSON object, progress goes to stderr.
Exit status 1 means the run did not complete, not that it was slow.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from app.local import REPO, LocalSystem
from libs.bus import Bus
from libs.contracts import names
from libs.contracts.bounds import derive
from libs.contracts.jobs import Job, PathClass
from libs.contracts.lifecycle import ProbeRecord
from libs.contracts.relay import Member as MemberRecord
from services.placer.config import DEFAULT_CONFIG
from tests.bench.running import (
    add_run_flags,
    bench_main,
    bench_parser,
    machine_facts,
    progress,
    run_bench,
)
from tests.bench.sampling import idle_cores
from tests.e2e import relayed_lab
from tests.e2e.nodus_cli import nodus
from tests.e2e.relayed_lab import Lab, billed, new_system, program_env, start_lab

log = progress("relayed_gang")
_systems: list[LocalSystem] = []

SENDER = """
import socket, sys, time
host, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
chunk = bytes(65536)
sent = 0
with socket.create_connection((host, port), timeout=30) as sock:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sock.sendall(chunk)
        sent += len(chunk)
    sock.shutdown(socket.SHUT_WR)
    sock.recv(1)
print(sent, flush=True)
"""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = bench_parser("relayed_gang", __doc__)
    parser.add_argument("--members", default="2,4,8", help="gang sizes (2..8), comma-separated")
    parser.add_argument("--seconds", type=float, default=8.0, help="each ring's iperf3 run")
    parser.add_argument("--failover", default="8", help="sizes whose streams see a relay killed")
    parser.add_argument("--failover-seconds", type=float, default=8.0, help="each stream")
    parser.add_argument("--sample-seconds", type=float, default=2.0, help="the probe's sample")
    parser.add_argument(
        "--qualify",
        action="store_true",
        help="admit gangs of more than 2 by `nodus qualify --members N`, not the placer's override",
    )
    add_run_flags(parser, budget=900.0, quick="2 and 4 members, 2-s streams, failover with 4")
    args = parser.parse_args(argv)
    if args.quick:
        args.members, args.seconds, args.failover = "2,4", 2.0, "4"
        args.failover_seconds, args.sample_seconds = 4.0, 1.0
    args.sizes = [int(n) for n in str(args.members).split(",") if n]
    args.failover_sizes = {int(n) for n in str(args.failover).split(",") if n}
    if any(not 2 <= n <= 8 for n in args.sizes):
        parser.error(f"--members: sizes from 2 to 8, not {args.members}")
    return args


def jain(values: list[float]) -> float | None:
    return (
        round(sum(values) ** 2 / (len(values) * sum(v * v for v in values)), 4)
        if any(values)
        else None
    )


OFFERINGS = "vast/container+lambda/vm"  # relayed_lab.fleet's two kinds of machine


def system_for(size: int, state: Path, sample_seconds: float, override: bool) -> LocalSystem:
    root = state / f"gang-{size}"
    system = new_system(root, relayed_lab.fleet(f"g{size}", 10 + 10 * size, members=size))
    if override:
        config = yaml.safe_load(DEFAULT_CONFIG.read_text())
        config["relayedMaxMembers"] = size
        (root / "placer.yaml").write_text(yaml.safe_dump(config))
        system.placer_config = root / "placer.yaml"
    system.probe_seconds = sample_seconds
    return system


def qualify(system: LocalSystem, size: int) -> dict[str, Any]:
    """`nodus qualify --path relayed --members N` as an operator runs it: its record."""
    started = time.monotonic()
    done = nodus(
        *("qualify", "--path", "relayed", "--members", str(size), "--offerings", OFFERINGS),
        *("--mib", "4", "-o", "json", "--nats", system.url),
    )
    if done.returncode != 0:
        raise RuntimeError(f"nodus qualify --members {size}: {done.stdout}{done.stderr}")
    record: dict[str, Any] = json.loads(done.stdout)
    return {
        "seconds": round(time.monotonic() - started, 2),
        "ok": record["ok"],
        "members": record["members"],
        "pair": record["pair"],
        "machines": len(record["machines"]),
        "tcpGbps": record["tcpGbps"],
        "allreduceBusGbps": record["allreduceBusGbps"],
    }


def probe_figures(lab: Lab, sample: float) -> dict[str, Any]:
    async def read() -> dict[str, Any]:
        bus = await Bus.open(lab.system.url, name="bench-relayed-gang", buckets=names.ALL_BUCKETS)
        try:
            job = await bus.bucket(names.BUCKET_JOBS, Job).get(f"acme.{lab.job_name}")
            assert job is not None, f"no job {lab.job_name}"
            return await _probe_figures(bus, job.value, sample)
        finally:
            await bus.close()

    return asyncio.run(read())


async def _probe_figures(bus: Bus, job: Job, sample: float) -> dict[str, Any]:
    key = names.epoch_key(job.key, job.status.epoch)
    found = await bus.bucket(names.BUCKET_PROBES, ProbeRecord).get(key)
    assert found is not None, f"no probe record for {job.key}"
    record = found.value
    members = await bus.bucket(names.BUCKET_MEMBERS, MemberRecord).snapshot(
        f"{job.key}.{job.status.epoch}.*"
    )
    last_join = max(m.value.joined_time for m in members.values())
    assert record.finished_time is not None, f"the probe of {job.key} has not finished"
    rounds_start = max(record.started_time, last_join)
    wall = (record.finished_time - record.started_time).total_seconds()
    rounds_wall = (record.finished_time - rounds_start).total_seconds()
    s = job.status
    probe = s.gang.probe if s.gang else None
    return {
        "rounds": record.rounds,
        "pairs": len(record.pairs),
        "sampleSeconds": sample,
        "probeWallSeconds": round(wall, 3),
        "roundsWallSeconds": round(rounds_wall, 3),
        "overRoundsTimesSample": round(wall - record.rounds * sample, 3),
        "applyToRunningSeconds": round((s.run_started_time - s.created_time).total_seconds(), 3)
        if s.run_started_time and s.created_time
        else None,
        "slowestPairGbps": probe.tcp_gbps if probe else None,
    }


def ring(lab: Lab, seconds: float, logs: Path) -> dict[str, Any]:
    before = lab.run(billed)
    idle = idle_cores()
    reports = relayed_lab.ring_iperf3(lab, seconds, logs)
    gbps = [r["sum_received"]["bits_per_second"] / 1e9 for r in reports]
    sent = {m.node: int(r["sum_sent"]["bytes"]) for m, r in zip(lab.members, reports, strict=True)}
    received = {
        m.node: int(r["sum_received"]["bytes"]) for m, r in zip(lab.members, reports, strict=True)
    }
    grown: dict[str, int] = {}
    for _ in range(50):  # the relays publish usage every second or so
        after = lab.run(billed)
        grown = {node: after.get(node, 0) - before.get(node, 0) for node in sent}
        if all(grown[node] >= received[node] for node in sent):
            break
        time.sleep(0.2)
    share = derive(PathClass.RELAYED, len(lab.members)).relay_member_bits_per_second / 1e9
    return {
        "seconds": seconds,
        "idleCoresBefore": round(idle, 2),
        "memberShareGbps": round(share, 4),
        "perMemberGbps": [round(g, 4) for g in gbps],
        "minOverShare": round(min(gbps) / share, 4) if share else None,
        "jain": jain(gbps),
        "gangTotalGbps": round(sum(gbps), 4),
        # What each program sent: its peer received at least `received` of it; what was still
        # in the sender's tunnel when iperf3 closed the test may or may not have crossed.
        "billedOverSent": [round(grown[n] / sent[n], 5) if sent[n] else None for n in sent],
        "billedOverReceived": [
            round(grown[n] / received[n], 5) if received[n] else None for n in sent
        ],
    }


class Receiver:
    """A stream's far end on a member's address: the bytes it got and its longest silence
    between arrivals, once the first byte came."""

    def __init__(self, host: str) -> None:
        self.listener = socket.create_server((host, 0))
        self.port = self.listener.getsockname()[1]
        self.received = 0
        self.longest_gap = 0.0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.listener.settimeout(60)
        connection, _ = self.listener.accept()
        with connection:
            connection.settimeout(30)
            last = None
            while True:
                data = connection.recv(1 << 16)
                now = time.monotonic()
                if not data:
                    break
                if last is not None:
                    self.longest_gap = max(self.longest_gap, now - last)
                last = now
                self.received += len(data)
            connection.sendall(b"k")

    def close(self) -> None:
        self.listener.close()


def failover(lab: Lab, seconds: float) -> dict[str, Any]:
    """Every member streams to the next; the relay most of them send through is killed a
    third of the way in and started again."""
    homes_before = {m.node: lab.home_relay(m.node) for m in lab.members}
    victim = Counter(homes_before.values()).most_common(1)[0][0]
    assert victim is not None, homes_before
    receivers = []
    senders = []
    try:
        for member in lab.members:
            nxt = lab.members[(member.rank + 1) % len(lab.members)]
            receiver = Receiver(nxt.address)
            receivers.append(receiver)
            senders.append(
                subprocess.Popen(
                    [sys.executable, "-c", SENDER, nxt.address, str(receiver.port), str(seconds)],
                    env=program_env(member.env),
                    cwd=REPO,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        time.sleep(seconds / 3)
        killed_at = time.monotonic()
        lab.kill_relay(victim)
        moved_within = None
        while time.monotonic() - killed_at < seconds:
            if all(lab.home_relay(m.node) not in (victim, None) for m in lab.members):
                moved_within = round(time.monotonic() - killed_at, 3)
                break
            time.sleep(0.05)
        sent = []
        for sender in senders:
            out, err = sender.communicate(timeout=seconds + 60)
            sent.append(int(out.strip()) if sender.returncode == 0 and out.strip() else None)
            if sender.returncode != 0:
                log(f"a sender failed: {err[-500:]}")
        for receiver in receivers:
            receiver.thread.join(30)
        lab.restart_relay(victim)
    finally:
        for sender in senders:
            if sender.poll() is None:
                sender.kill()
                sender.wait()
        for receiver in receivers:
            receiver.close()
    gaps = [round(r.longest_gap * 1000, 1) for r in receivers]
    broken = sum(1 for s, r in zip(sent, receivers, strict=True) if s is None or s != r.received)
    return {
        "seconds": seconds,
        "killed": victim,
        "membersOnKilled": sum(1 for h in homes_before.values() if h == victim),
        "allMovedWithinSeconds": moved_within,
        "longestGapMsPerMember": gaps,
        "longestGapMs": max(gaps),
        "streamsBroken": broken,
        "intact": broken == 0,
    }


def one_size(args: argparse.Namespace, size: int, state: Path) -> dict[str, Any]:
    qualifying = args.qualify and size > 2
    system = system_for(size, state, args.sample_seconds, override=not qualifying)
    _systems.append(system)
    try:
        qualification = None
        if qualifying:
            asyncio.run(system.start(timeout=90))
            qualification = qualify(system, size)
            log(f"{size} members: qualified {qualification}")
        started = time.monotonic()
        lab = asyncio.run(
            start_lab(system, f"gang{size}", ["sleep", "900"], members=size, started=qualifying)
        )
        result: dict[str, Any] = {
            "qualification": qualification,
            "members": size,
            "startToRunningSeconds": round(time.monotonic() - started, 2),
        }
        homes = Counter(lab.home_relay(m.node) for m in lab.members)
        result["membersPerRelay"] = sorted(homes.values())
        result["probe"] = probe_figures(lab, args.sample_seconds)
        log(f"{size} members: probe {result['probe']['probeWallSeconds']} s; the ring")
        result["ring"] = ring(lab, args.seconds, system.state_dir)
        log(f"{size} members: {result['ring']['perMemberGbps']} Gbit/s")
        if size in args.failover_sizes:
            result["failover"] = failover(lab, args.failover_seconds)
            log(f"{size} members: failover {result['failover']}")
        return result
    finally:
        system.stop()
        _systems.remove(system)


def run(args: argparse.Namespace) -> dict[str, Any]:
    async def body(state: Path) -> dict[str, Any]:
        result: dict[str, Any] = {
            "params": {
                "members": args.sizes,
                "seconds": args.seconds,
                "failover": sorted(args.failover_sizes),
                "sampleSeconds": args.sample_seconds,
            },
            "machine": machine_facts(),
        }
        result["gangs"] = [
            await asyncio.to_thread(one_size, args, size, state) for size in args.sizes
        ]
        return result

    return run_bench("nodus-bench-relayed-gang-", body, args, cleanup)


def cleanup() -> None:
    for system in list(_systems):
        system.stop()
    _systems.clear()


def main(argv: Sequence[str] | None = None) -> int:
    return bench_main(run, parse_args(argv), cleanup)


if __name__ == "__main__":
    sys.exit(main())

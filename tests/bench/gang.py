"""Gang life benchmark (issue 5): the probe, the way to Running, the workload on the Relayed path.

    .venv/bin/python -m tests.bench.gang            # 2, 4 and 8 members, 2 s samples, 16 MiB
    .venv/bin/python -m tests.bench.gang --quick    # 2 and 4 members, 0.3 s samples, 2 MiB

Everything runs as real processes (`LocalSystem`: nats-server, placer, runner, two meshed
relays, one agent per machine) on a fleet written to a temporary state dir: `max(members)` VMs
of one provider region on one private network (127.0.2.x) and an L4 container + L4 VM pair in
another region class for the Relayed path. Jobs run one at a time and are deleted when they end.

1. Probe wall time for N members (Private gangs; the command is `python -c pass`). The runner
   measures every pair once in `rounds(N)` rounds (services/runner/schedule.py: N/2 rounds,
   each member sending one sample and receiving one). Per pair: readiness (3 fresh connections each way, each a connect and a 1-byte
   exchange: ~6 RTT), RTT (one connect and 21 pings: ~22 RTT), a throughput sample of
   `--sample-seconds` (plus its connect and the byte count back: ~2 RTT). The minimum a round
   allows is therefore sample + 30 x RTT (RTT: the slowest pair of the round, as measured), and
   the minimum of the probe is the sum over its rounds. Reported: the runner's wall time
   (probe record startedTime..finishedTime, which includes waiting for the members to join),
   the rounds' wall time (from the last member's join to finishedTime), each round's time
   (from the pairs' measuredTime), and the overhead over the minimum.
2. Apply to Running for a Relayed pair, split as: placement (createdTime -> placedTime), join
   (placedTime -> the last Member record's joinedTime), probe (probe record startedTime ->
   finishedTime; it starts at placement, so it overlaps the join: `probeAfterJoinSeconds` is
   the part after the last join, shim self-tests included), launch (probe finishedTime ->
   runStartedTime).
3. The example all-reduce (examples/workloads/allreduce.py) on that Relayed pair, through the
   shim, the agents' tunnels and the relays (rate-limited as in production: 1 Gbit/s per gang,
   split across its members; `--no-relay-rate-limit` lifts it), against the same workload, same
   size and iterations, run by this bench with two ranks on 127.0.0.x over direct loopback.
   Also the relay bytes billed in status.billing against what `nodus usage` shows afterwards.

Speed is reported, never asserted; stdout carries one JSON object, progress goes to stderr.
Exit status 1 means the run did not complete, not that it was slow.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import yaml

from app.local import REPO, LocalSystem
from libs.bus import Bus
from libs.bus.server import free_port
from libs.client.client import Client
from libs.contracts import names
from libs.contracts.bounds import derive
from libs.contracts.epochs import Lease
from libs.contracts.jobs import Job, PathClass, Phase
from libs.contracts.lifecycle import PairResult, ProbeRecord
from libs.contracts.relay import Member
from services.runner.schedule import rounds
from tests.bench.running import add_run_flags, bench_main, bench_parser, progress
from tests.factories import job

WORKLOAD = REPO / "examples" / "workloads" / "allreduce.py"
ORG = "acme"
# Per pair: readiness ~6 RTT, RTT phase ~22 RTT, the sample's connect and reply ~2 RTT.
RTTS_PER_PAIR = 30
LOOPBACK = ("127.0.0.61", "127.0.0.62")


log = progress("gang")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = bench_parser("gang", __doc__)
    parser.add_argument("--members", default="2,4,8", help="gang sizes whose probe is timed (2..8)")
    parser.add_argument(
        "--sample-seconds", type=float, default=2.0, help="the probe's throughput sample"
    )
    parser.add_argument("--mib", type=int, default=16, help="ALLREDUCE_MIB of the workload")
    parser.add_argument("--iters", type=int, default=3, help="ALLREDUCE_ITERS of the workload")
    parser.add_argument(
        "--no-relay-rate-limit", action="store_true", help="relays without the per-gang cap"
    )
    add_run_flags(parser, 600.0, "2 and 4 members, 0.3 s samples, 2 MiB (smoke)")
    args = parser.parse_args(argv)
    if args.quick:
        args.members, args.sample_seconds, args.mib, args.iters = "2,4", 0.3, 2, 1
    args.sizes = sorted({int(n) for n in str(args.members).split(",") if n.strip()})
    if not args.sizes or min(args.sizes) < 2 or max(args.sizes) > 8:
        parser.error("--members takes sizes between 2 and 8")
    return args


# -- the fleet -----------------------------------------------------------------------------------


def fleet(vms: int) -> dict[str, Any]:
    machines: list[dict[str, Any]] = [
        {
            "name": f"bench-vm-{i}",
            "provider": "aws",
            "region": "us-east-1",
            "regionClass": "us",
            "offering": "vm",
            "address": f"127.0.1.{101 + i}",
            "privateNetwork": "bench-vpc",
            "privateAddress": f"127.0.2.{101 + i}",
            "privateInterface": "ens5",
            "pool": "h100",
            "cluster": "us",
            "accelerators": {"count": 8, "backend": "cuda", "model": "H100"},
        }
        for i in range(vms)
    ]
    for name, provider, offering, index in (
        ("bench-ctr", "vast", "container", 111),
        ("bench-l4vm", "lambda", "vm", 112),
    ):
        machines.append(
            {
                "name": name,
                "provider": provider,
                "region": "eu-central-1",
                "regionClass": "eu",
                "offering": offering,
                "address": f"127.0.1.{index}",
                "pool": "l4",
                "cluster": "eu",
                "accelerators": {"count": 1, "backend": "cuda", "model": "L4"},
            }
        )
    return {"machines": machines}


# -- helpers -------------------------------------------------------------------------------------


def seconds(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    return round((end - start).total_seconds(), 3)


class Bench:
    def __init__(self, args: argparse.Namespace, system: LocalSystem, client: Client, bus: Bus):
        self.args = args
        self.system = system
        self.client = client
        self.bus = bus
        self.deadline: float = time.monotonic() + float(args.budget)

    def left(self, cap: float) -> float:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"the bench's budget of {self.args.budget:g}s is spent")
        return min(cap, remaining)

    async def wait_job(self, name: str, until: Callable[[Job], bool], cap: float) -> Job:
        limit = self.left(cap)
        deadline = time.monotonic() + limit
        last: Job | None = None
        while time.monotonic() < deadline:
            last = await self.client.get_job(name, ORG)
            if until(last):
                return last
            await asyncio.sleep(0.05)
        raise TimeoutError(
            f"job {name} did not get there within {limit:g}s; last status "
            f"{last.status if last else None}; logs in {self.system.state_dir / 'logs'}"
        )

    async def finish(self, name: str, nodes: list[str]) -> None:
        """Delete the job and wait until its machines are free for the next one."""
        await self.client.delete(name, ORG)
        leases = self.bus.bucket(names.BUCKET_LEASES, Lease)
        deadline = time.monotonic() + self.left(30)
        while time.monotonic() < deadline:
            held = await leases.snapshot()
            if not set(held) & set(nodes):
                return
            await asyncio.sleep(0.1)
        raise TimeoutError(f"the machines of {name} were not freed after its deletion")

    async def members(self, job: Job) -> list[Member]:
        bucket = self.bus.bucket(names.BUCKET_MEMBERS, Member)
        found = await bucket.snapshot(f"{job.key}.{job.status.epoch}.*")
        return [v.value for v in found.values()]

    async def probe_record(self, job: Job) -> ProbeRecord:
        bucket = self.bus.bucket(names.BUCKET_PROBES, ProbeRecord)
        found = await bucket.get(names.epoch_key(job.key, job.status.epoch))
        if found is None:
            raise RuntimeError(f"no probe record for {job.key} epoch {job.status.epoch}")
        return found.value

    # -- 1. probe wall time ----------------------------------------------------------------------

    async def probe(self, size: int) -> dict[str, Any]:
        name = f"probe-{size}"
        await self.client.apply(
            job(
                name,
                org=ORG,
                command=[sys.executable, "-c", "pass"],
                accelerators={"model": "H100"},
                distributed={"members": size, "network": "Colocated", "transport": "Direct"},
            )
        )
        done = await self.wait_job(
            name, lambda j: j.status.phase in (Phase.SUCCEEDED, Phase.FAILED), 120
        )
        if done.status.phase is not Phase.SUCCEEDED or done.status.gang is None:
            raise RuntimeError(f"{name} ended {done.status.phase}: {done.status.conditions}")
        record = await self.probe_record(done)
        joined = [m.joined_time for m in await self.members(done)]
        nodes = [m.node for m in sorted(done.status.gang.members, key=lambda m: m.rank)]
        schedule = rounds(nodes)
        sample = self.args.sample_seconds
        last_join = max(joined)
        rounds_start = max(record.started_time, last_join)
        per_round: list[dict[str, Any]] = []
        pairs = list(record.pairs)
        previous_end = rounds_start
        minimum = 0.0
        for index, planned in enumerate(schedule):
            measured: list[PairResult] = pairs[: len(planned)]
            pairs = pairs[len(planned) :]
            end = max(p.measured_time for p in measured if p.measured_time)
            rtt_ms = max(p.rtt_ms for p in measured)
            round_minimum = sample + RTTS_PER_PAIR * rtt_ms / 1000
            minimum += round_minimum
            per_round.append(
                {
                    "round": index + 1,
                    "pairs": [f"{p.a}-{p.b}" for p in measured],
                    "seconds": seconds(previous_end, end),
                    "minimumSeconds": round(round_minimum, 4),
                    "slowestGbps": min(p.tcp_gbps for p in measured),
                    "maxRttMs": rtt_ms,
                }
            )
            previous_end = end
        wall = seconds(record.started_time, record.finished_time) or 0.0
        rounds_wall = seconds(rounds_start, record.finished_time) or 0.0
        probe = done.status.gang.probe
        result = {
            "members": size,
            "path": done.status.gang.transport.value,
            "rounds": record.rounds,
            "pairs": len(record.pairs),
            "sampleSeconds": sample,
            "probeWallSeconds": wall,
            "joinWaitSeconds": seconds(record.started_time, rounds_start),
            "roundsWallSeconds": rounds_wall,
            "minimumSeconds": round(minimum, 4),
            "minimumFormula": f"sum over rounds of (sample + {RTTS_PER_PAIR} x slowest RTT)",
            "overheadSeconds": round(rounds_wall - minimum, 3),
            "overheadPerRoundSeconds": round((rounds_wall - minimum) / record.rounds, 3),
            "roundsWallOverMinimum": round(rounds_wall / minimum, 3) if minimum else None,
            "perRound": per_round,
            "slowestPair": {"tcpGbps": probe.tcp_gbps, "rttMs": probe.rtt_ms, "path": probe.path}
            if probe
            else None,
        }
        await self.finish(name, nodes)
        return result

    # -- 2 and 3. a Relayed pair: the way to Running, then the workload --------------------------

    async def relayed(self) -> dict[str, Any]:
        name = "relayed-pair"
        await self.client.apply(
            job(
                name,
                org=ORG,
                command=[sys.executable, str(WORKLOAD)],
                env={"ALLREDUCE_MIB": str(self.args.mib), "ALLREDUCE_ITERS": str(self.args.iters)},
                accelerators={"model": "L4"},
                distributed={"members": 2, "transport": "Auto"},
            )
        )
        done = await self.wait_job(
            name, lambda j: j.status.phase in (Phase.SUCCEEDED, Phase.FAILED), 180
        )
        reports = []
        for rank in range(2):
            lines = (await self.client.logs(name, rank, 0, ORG)).data.strip().splitlines()
            reports.append(json.loads(lines[-1]) if lines else {})
        if done.status.phase is not Phase.SUCCEEDED or done.status.gang is None:
            raise RuntimeError(f"{name} ended {done.status.phase}: {done.status.conditions}")
        if done.status.gang.transport is not PathClass.RELAYED:
            raise RuntimeError(f"{name} was placed on {done.status.gang.transport}")
        record = await self.probe_record(done)
        last_join = max(m.joined_time for m in await self.members(done))
        s = done.status
        startup = {
            "placementSeconds": seconds(s.created_time, s.placed_time),
            "joinSeconds": seconds(s.placed_time, last_join),
            "probeSeconds": seconds(record.started_time, record.finished_time),
            "probeAfterJoinSeconds": seconds(last_join, record.finished_time),
            "launchSeconds": seconds(record.finished_time, s.run_started_time),
            "applyToRunningSeconds": seconds(s.created_time, s.run_started_time),
            "probe": {
                "tcpGbps": s.gang.probe.tcp_gbps if s.gang and s.gang.probe else None,
                "rttMs": s.gang.probe.rtt_ms if s.gang and s.gang.probe else None,
                "path": s.gang.probe.path if s.gang and s.gang.probe else None,
            },
        }
        await asyncio.sleep(2.5)  # relays flush usage every second: let the last counts land
        usage = (await self.client.usage()).get(done.key, 0)
        billed = round((s.billing.mesh_relay_gi_b if s.billing else 0.0) * 2**30)
        billing = {
            "bootSeconds": s.billing.boot_seconds if s.billing else None,
            "runSeconds": s.billing.run_seconds if s.billing else None,
            "billedRelayBytes": billed,
            "usageRelayBytesAfterwards": usage,
            "unbilledBytes": usage - billed,
        }
        await self.finish(name, [m.node for m in done.status.gang.members])
        return {
            "startup": startup,
            "workload": {"ranks": reports, "busGbps": _bus(reports)},
            "billing": billing,
        }

    def loopback(self) -> dict[str, Any]:
        """The same workload with two ranks over direct loopback (no shim, no relays)."""
        port = free_port()
        env = {
            **{k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")},
            "MASTER_ADDR": LOOPBACK[0],
            "MASTER_PORT": str(port),
            "WORLD_SIZE": "2",
            "NODUS_NODE_IPS": ",".join(LOOPBACK),
            "ALLREDUCE_MIB": str(self.args.mib),
            "ALLREDUCE_ITERS": str(self.args.iters),
        }
        processes = [
            subprocess.Popen(
                [sys.executable, str(WORKLOAD)],
                env={**env, "RANK": str(rank), "NODE_RANK": str(rank)},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank in range(2)
        ]
        reports = []
        try:
            for process in processes:
                out, err = process.communicate(timeout=self.left(120))
                if process.returncode != 0:
                    raise RuntimeError(f"loopback rank failed ({process.returncode}): {err[-400:]}")
                reports.append(json.loads(out.strip().splitlines()[-1]))
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait()
        return {"addresses": list(LOOPBACK), "ranks": reports, "busGbps": _bus(reports)}


def _bus(reports: list[dict[str, Any]]) -> float | None:
    """The gang's bus bandwidth: the slowest rank's (every rank takes part in every step)."""
    values = [float(r["busGbps"]) for r in reports if "busGbps" in r]
    return min(values) if values else None


# -- running -------------------------------------------------------------------------------------


async def run_async(args: argparse.Namespace, state: Path) -> dict[str, Any]:
    result: dict[str, Any] = {
        "config": {
            "members": args.sizes,
            "sampleSeconds": args.sample_seconds,
            "allreduceMiB": args.mib,
            "allreduceIters": args.iters,
            "relayRateLimit": not args.no_relay_rate_limit,
            "relayMemberBitsPerSecond": 0
            if args.no_relay_rate_limit
            else derive(PathClass.RELAYED, 2).relay_member_bits_per_second,
            "cpus": os.cpu_count(),
        }
    }
    fleet_path = state / "fleet.yaml"
    fleet_path.write_text(yaml.safe_dump(fleet(max(args.sizes))))
    system = LocalSystem(
        fleet_path=fleet_path,
        state_dir=state / "system",
        nats_port=free_port(),
        probe_seconds=args.sample_seconds,
        heartbeat_seconds=1.0,
        relay_args=["--no-rate-limit"] if args.no_relay_rate_limit else [],
    )
    started = time.monotonic()
    log(f"starting the system ({len(fleet(max(args.sizes))['machines'])} machines)")
    try:
        await system.start(timeout=min(120, args.budget))
    except BaseException:
        system.stop()  # what started before the failure: nothing is left running
        raise
    result["systemStartSeconds"] = round(time.monotonic() - started, 3)
    try:
        client = await Client.connect(system.url)
        bus = await Bus.open(system.url, name="bench-gang", buckets=names.ALL_BUCKETS)
    except BaseException:
        system.stop()
        raise
    try:
        bench = Bench(args, system, client, bus)
        result["probe"] = []
        for size in args.sizes:
            log(f"probe of a {size}-member gang")
            result["probe"].append(await bench.probe(size))
        log("a Relayed pair: apply -> Running -> Succeeded with the all-reduce")
        relayed = await bench.relayed()
        result["relayedStartup"] = relayed["startup"]
        result["relayedBilling"] = relayed["billing"]
        log("the same all-reduce over direct loopback")
        baseline = bench.loopback()
        relayed_bus, loop_bus = relayed["workload"]["busGbps"], baseline["busGbps"]
        result["allreduce"] = {
            "relayed": relayed["workload"],
            "loopback": baseline,
            "relayedOverLoopback": round(relayed_bus / loop_bus, 4)
            if relayed_bus and loop_bus
            else None,
        }
    finally:
        await bus.close()
        await client.close()
        system.stop()
    result["logs"] = str(system.state_dir / "logs")
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    """One bench run; the state dir (logs) is removed unless kept or the run failed."""
    state = Path(tempfile.mkdtemp(prefix="nodus-bench-gang-"))
    try:
        result = asyncio.run(run_async(args, state))
    except KeyboardInterrupt:  # SIGTERM or Ctrl-C: the run's `finally` stopped the system
        return {
            "error": "stopped by SIGTERM or Ctrl-C before the run finished",
            "state": str(state),
        }
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}", "state": str(state)}
    if args.keep_state:
        result["state"] = str(state)
    else:
        shutil.rmtree(state, ignore_errors=True)
        result.pop("logs", None)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    """SIGTERM and Ctrl-C stop the run with its `finally` (every process it started stopped),
    and the operator's credentials are the run's own (running.bench_main)."""
    return bench_main(run, parse_args(argv), lambda: None)


if __name__ == "__main__":
    sys.exit(main())

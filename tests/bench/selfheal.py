"""How fast a gang heals (R17): `nodus up` (its real daemons) with N+1 H100 VMs on one VPC,
the policy automatic for reboots and power cycles, an N-member Private gang running the
checkpointed all-reduce; then Xid 79 (a GPU off the bus) written into a member's kernel log.

From the fault line, seconds to: the alert, the gang's old epoch fenced, the new epoch placed,
Running again, the recommendation (after the persistence window), the repair done and the
machine back (uncordoned). The floor is the same gang's own first placement to Running
(placement and the probe), measured in the same run.

    python -m tests.bench.selfheal [--members 2,8] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from app.lab import faults
from app.local import LocalSystem
from libs.bus import Bus
from libs.bus.server import free_port
from libs.client.client import Client, parse_job
from libs.contracts import names
from libs.contracts.epochs import Epoch
from libs.contracts.jobs import Job, Phase
from libs.contracts.remediation import (
    Action,
    Alert,
    Cordon,
    Policy,
    Recommendation,
    Remediation,
    RemediationState,
)
from tests.bench.running import (
    add_run_flags,
    bench_main,
    bench_parser,
    machine_facts,
    progress,
    run_bench,
)

log = progress("selfheal")
REPO = Path(__file__).resolve().parents[2]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = bench_parser("selfheal", __doc__)
    parser.add_argument("--members", default="2,8", help="gang sizes, comma separated")
    add_run_flags(parser, budget=900, quick="2 members only")
    args = parser.parse_args(argv)
    if args.quick:
        args.members = "2"
    return args


def _fleet(machines: int) -> str:
    rows = [
        f"  - {{name: h-{i}, provider: aws, region: us-east-1, regionClass: us, offering: vm,\n"
        f"     address: 127.0.6.{i + 1}, privateNetwork: use1-vpc, "
        f"privateAddress: 127.0.7.{i + 1},\n"
        f"     privateInterface: lo, pool: pool-{i}, cluster: c1,\n"
        f"     accelerators: {{count: 8, backend: cuda, model: H100}}}}\n"
        for i in range(machines)
    ]
    return "machines:\n" + "".join(rows)


def _write_fleet(state: Path, machines: int) -> Path:
    state.mkdir(parents=True, exist_ok=True)
    fleet = state / "fleet.yaml"
    fleet.write_text(_fleet(machines))
    return fleet


class Firsts:
    """When (monotonic) each thing was first seen, by watching the buckets as it happens."""

    def __init__(self) -> None:
        self.seen: dict[str, float] = {}

    def mark(self, what: str) -> None:
        self.seen.setdefault(what, time.monotonic())


async def _watch(bus: Bus, gang: str, victim: str, firsts: Firsts) -> None:
    async def alerts() -> None:
        async for change in bus.bucket(names.BUCKET_ALERTS, Alert).watch(f"{victim}.>"):
            if change.value is not None and change.value.breaks_workload:
                firsts.mark("alert")

    async def recommendations() -> None:
        async for change in bus.bucket(names.BUCKET_RECOMMENDATIONS, Recommendation).watch():
            if change.value is not None and change.value.node == victim:
                firsts.mark("recommendation")

    async def epochs() -> None:
        async for change in bus.bucket(names.BUCKET_EPOCHS, Epoch).watch(f"{gang}.>"):
            epoch = change.value
            if epoch is not None and epoch.epoch == 1 and epoch.fenced:
                firsts.mark("old_epoch_fenced")

    async def jobs() -> None:
        async for change in bus.bucket(names.BUCKET_JOBS, Job).watch(gang):
            job = change.value
            if job is None or job.status.epoch < 2:
                continue
            if job.status.phase in (Phase.PLACED, Phase.PROBING, Phase.RUNNING):
                firsts.mark("new_epoch_placed")
            if job.status.phase is Phase.RUNNING:
                firsts.mark("running_again")

    async def repairs() -> None:
        async for change in bus.bucket(names.BUCKET_REMEDIATIONS, Remediation).watch(f"{victim}.>"):
            if change.value is not None and change.value.state is RemediationState.DONE:
                firsts.mark("repair_done")

    async def cordons() -> None:
        async for change in bus.bucket(names.BUCKET_CORDONS, Cordon).watch(victim):
            if change.value is not None and change.value.holds:
                firsts.mark("cordoned")
            elif "cordoned" in firsts.seen:
                firsts.mark("back_in_pool")

    await asyncio.gather(alerts(), recommendations(), epochs(), jobs(), repairs(), cordons())


async def _until(check: Any, timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = await check()
        if found:
            return found
        await asyncio.sleep(0.2)
    raise TimeoutError(f"{what} not within {timeout:g} s")


async def _scenario(members: int, state: Path) -> dict[str, Any]:
    fleet = _write_fleet(state, members + 1)
    system = LocalSystem(fleet_path=fleet, state_dir=state, nats_port=free_port(), relays=2)
    await system.start()
    try:
        assert system.nats is not None
        client = await Client.connect(system.url, system.nats.credentials)
        bus = client.bus
        for name in names.REMEDIATION_BUCKETS:  # the client opens the job buckets only
            await bus.ensure_bucket(name)
        await bus.bucket(names.BUCKET_REMEDIATION_POLICY, Policy).put(
            "default",
            Policy(mode="Automatic", trusted_actions=[Action.REBOOT, Action.POWER_CYCLE]),
        )
        spec = {
            "apiVersion": "nodus/v1",
            "kind": "Job",
            "metadata": {"name": f"heal-{members}", "org": "acme"},
            "spec": {
                "command": ["python3", "examples/workloads/allreduce.py"],
                "env": {"ALLREDUCE_MIB": "1", "ALLREDUCE_ITERS": "600",
                        "ALLREDUCE_STEP_SECONDS": "1"},
                "accelerators": {"count": 8, "backend": "cuda", "model": "H100"},
                "distributed": {"members": members, "network": "Colocated", "transport": "Direct"},
            },
        }  # fmt: skip
        await client.apply(parse_job(json.dumps(spec)))
        gang = f"acme.heal-{members}"

        async def running_first() -> Job | None:
            current = await client.get_job(f"heal-{members}")
            return current if current.status.phase is Phase.RUNNING else None

        first = await _until(running_first, 180, "the first epoch running")
        placed, started = first.status.placed_time, first.status.run_started_time
        floor = (started - placed).total_seconds() if placed and started else None
        assert first.status.gang is not None
        victim = first.status.gang.members[-1].node
        firsts = Firsts()
        watcher = asyncio.create_task(_watch(bus, gang, victim, firsts))
        await asyncio.sleep(3)  # a few steps checkpointed; the watches caught up
        t0 = time.monotonic()
        faults.inject(system.machine_dir(victim), faults.Fault(kind="xid", xid=79))

        async def healed() -> bool:
            return "running_again" in firsts.seen and "back_in_pool" in firsts.seen

        try:
            await _until(healed, 240, "the gang running again and the machine back")
        finally:
            watcher.cancel()
            await client.delete(f"heal-{members}")
            await client.close()
        return {
            "members": members,
            "floor_first_placement_to_running_s": round(floor, 2) if floor else None,
            "from_fault_line_s": {k: round(v - t0, 2) for k, v in sorted(firsts.seen.items())},
        }
    finally:
        system.stop()


async def _body(state: Path, args: argparse.Namespace) -> dict[str, Any]:
    results = []
    for members in [int(m) for m in args.members.split(",") if m]:
        log(f"{members} members")
        results.append(await _scenario(members, state / f"m{members}"))
        log(json.dumps(results[-1]))
    return {"machine": machine_facts(), "gangs": results}


def run(args: argparse.Namespace) -> dict[str, Any]:
    return run_bench("nodus-bench-selfheal-", lambda state: _body(state, args), args, lambda: None)


def main(argv: list[str] | None = None) -> int:
    return bench_main(run, parse_args(argv), lambda: None)


if __name__ == "__main__":
    sys.exit(main())

"""A bounded, seeded chaos run (issue 14), Jepsen-style: the real system (`LocalSystem` on a
three-server NATS cluster, two placer replicas, the prober, the remediator and its monitor,
two meshed relays, one agent per machine) runs jobs on the Private, Relayed and Direct paths
(Direct in the network-namespace lab, when this machine has it) while a repair is in flight,
and a seeded loop SIGKILLs and restarts, in turn, a NATS server, a placer replica, the
prober, the remediator, a relay and an agent, and pauses one process (SIGSTOP) for longer
than its heartbeat. Afterwards it checks invariants, not timings:

- every job applied is final, or Running with exactly one live epoch;
- no machine is in two live epochs, and every lease names its job's live epoch;
- every epoch seen fenced stays fenced;
- each fault made at most one remediation, and each remediation ran each step once (its
  history never enters a state twice, its machine booted once per reboot);
- the mesh-relay bytes billed equal what the relays metered, within 0.1 %;
- every event of NODUS_EVENTS a client saw is in the stream afterwards.

(The daemons' logs are checked by the test's fixtures: no error, no traceback.) For each
fault it reports how long until the system was whole again: a KV write acknowledged and the
next job placed after the process came back.

    python -m tests.chaos.harness --seed 7 [--faults 7]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from app.demo import lab_unavailable
from app.lab import faults
from app.local import LocalSystem
from libs.bus import Bus
from libs.bus.server import NatsCluster
from libs.client.client import Client
from libs.contracts import names
from libs.contracts.epochs import Epoch, Lease
from libs.contracts.fleet import NodeHealth
from libs.contracts.jobs import FINISHED_PHASES as FINAL
from libs.contracts.jobs import Job, PathClass, Phase
from libs.contracts.remediation import (
    TERMINAL_STATES,
    Action,
    Alert,
    AlertKind,
    AlertState,
    Policy,
    Remediation,
    RemediationState,
)
from services.prober.billing import SWEEP_SECONDS as LATE_USAGE_SWEEP_SECONDS
from tests.chaos.broken import DEFECT_VARIABLE
from tests.chaos.workload import EXPECTED, REPAIR_NODE, SUCCEEDED_EVENTS, fleet, job, path_of
from tests.e2e.daemon_logs import DaemonLogs

KINDS = ("nats", "placer", "prober", "remediator", "relay", "agent", "pause")
HEARTBEAT_SECONDS = 1.0
BILLING_TOLERANCE = 0.001
SETTLE_SECONDS = 150.0  # for every job applied to end, after the last fault
GIB = float(1 << 30)


@dataclass
class FaultRecord:
    kind: str
    target: str
    at: float  # seconds into the run
    down_seconds: float
    bus_whole_seconds: float | None = None  # a KV write acknowledged after the restore
    next_placement_seconds: float | None = None  # a job placed after the restore
    next_relay_bytes_seconds: float | None = None  # bytes metered by a relay after it
    next_alert_seconds: float | None = None  # after a remediator restart: a new fault alerted


@dataclass
class Report:
    seed: int
    netns: bool = False  # machines in network namespaces, Direct gangs over nodus0
    faults: list[FaultRecord] = field(default_factory=list)
    jobs: dict[str, str] = field(default_factory=dict)  # name -> phase
    succeeded: dict[str, int] = field(default_factory=dict)  # path -> jobs that Succeeded
    repair: str | None = None  # the repair in flight's final state
    violations: list[str] = field(default_factory=list)
    events_seen: int = 0
    remediations: int = 0
    seconds: float = 0.0


class Chaos:
    def __init__(
        self,
        state: Path,
        seed: int,
        faults: int = len(KINDS),
        netns: bool | None = None,
        kinds: tuple[str, ...] = KINDS,
        repair: bool = True,
        defect: str | None = None,
    ) -> None:
        """`kinds`, `repair` (a repair in flight) and `defect` (a daemon of a broken build,
        tests/chaos/broken.py) make the short runs of the harness's own tests."""
        self.state = state
        self.kinds = kinds
        self.repair = repair
        self.defect = defect
        # The lab when this machine has what it needs (root, ip, nft, wireguard-go).
        self.netns = lab_unavailable() is None if netns is None else netns
        self.seed = seed
        self.rng = random.Random(seed)
        self.fault_count = faults
        self.system: LocalSystem | None = None
        self.client: Client | None = None
        self.applied: list[str] = []
        self.placements: list[float] = []  # when a client saw a job placed (monotonic)
        self.metered: list[float] = []  # when a client saw a relay's usage record
        self._placed: dict[str, datetime] = {}
        self.events: dict[str, bytes] = {}  # Nats-Msg-Id -> data, as a client saw them
        self.fenced_seen: set[str] = set()
        self.report = Report(seed, self.netns)
        self.started = 0.0

    # -- the run ---------------------------------------------------------------------------

    async def run(self) -> Report:
        self.started = time.monotonic()
        self.state.mkdir(parents=True, exist_ok=True)
        (self.state / "fleet.yaml").write_text(fleet(self.netns))
        system = self.system = LocalSystem(
            fleet_path=self.state / "fleet.yaml",
            state_dir=self.state,
            nats_port=0,
            nats_cluster=3,
            placers=2,
            heartbeat_seconds=HEARTBEAT_SECONDS,
            probe_seconds=1.0,
            netns=self.netns,
            **self._broken(),
        )
        await system.start()
        try:
            assert system.nats is not None
            self.client = await Client.connect(system.url, system.nats.credentials)
            observers = await self._observe()
            policy = Policy(mode="Automatic", trusted_actions=[Action.REBOOT, Action.POWER_CYCLE])
            await self._put_policy(policy)
            # A repair in flight: a read-only root filesystem on a VPC machine.
            if self.repair:
                faults.inject(system.machine_dir("h-3"), faults.Fault(kind="readonly-fs"))
            workload = asyncio.create_task(self._apply_jobs())
            kinds = list(self.kinds)
            self.rng.shuffle(kinds)
            for kind in (kinds * 2)[: self.fault_count]:
                await asyncio.sleep(self.rng.uniform(2.0, 4.0))
                await self._fault(kind)
            workload.cancel()
            await self._settle()
            await self._check()
            for task in observers:
                task.cancel()
        finally:
            if self.client is not None:
                await self.client.close()
            system.stop()
        logs = DaemonLogs()
        logs.watch(self.state / "logs")
        self.report.violations += [f"log {finding}" for finding in logs.read_new()]
        self.report.seconds = round(time.monotonic() - self.started, 1)
        return self.report

    def _broken(self) -> dict[str, Any]:
        """The LocalSystem options that start the defect's daemon from the broken build."""
        if self.defect is None:
            return {}
        daemon = self.defect.split("-", 1)[0]  # prober-..., placer-..., relay-...
        return {
            "module": {daemon: "tests.chaos.broken"},
            "extra_env": {DEFECT_VARIABLE: self.defect, "NODUS_CHAOS_STATE": str(self.state)},
        }

    def stop(self) -> None:
        """Stop everything the run started; again is harmless (the run stops it itself)."""
        if self.system is not None:
            self.system.stop()

    async def _put_policy(self, policy: Policy) -> None:
        assert self.client is not None
        bus = self.client.bus
        await bus.ensure_bucket(names.BUCKET_REMEDIATION_POLICY)
        await bus.bucket(names.BUCKET_REMEDIATION_POLICY, Policy).put("default", policy)

    async def _apply_jobs(self) -> None:
        assert self.client is not None
        index = 0
        while True:
            try:
                await self.client.apply(job(index, self.netns))
                self.applied.append(f"chaos-{index}")
                index += 1
            except Exception as error:  # one server down must not refuse a client
                self.report.violations.append(
                    f"apply chaos-{index} refused or timed out: {type(error).__name__}: {error}"
                )
                index += 1
            await asyncio.sleep(4.0)

    # -- faults ------------------------------------------------------------------------------

    async def _fault(self, kind: str) -> None:
        system = self.system
        assert system is not None and isinstance(system.nats, NatsCluster)
        down = self.rng.uniform(2.0, 5.0)
        at = time.monotonic() - self.started
        if kind == "nats":
            index = self.rng.randrange(len(system.nats.servers))
            target = f"nats-n{index}"
            system.nats.kill(index)
            await asyncio.sleep(down)
            await asyncio.to_thread(system.nats.restart, index)
        elif kind == "pause":
            target = self.rng.choice(self._children())
            pid = system.child(target).process.pid
            down = max(down, HEARTBEAT_SECONDS * 4)  # longer than its heartbeat
            os.kill(pid, signal.SIGSTOP)
            await asyncio.sleep(down)
            os.kill(pid, signal.SIGCONT)
        else:
            target = self._target(kind)
            child = system.child(target)
            os.killpg(child.process.pid, signal.SIGKILL)
            child.process.wait()
            await asyncio.sleep(down)
            system.restart(target)
        restored = time.monotonic()
        record = FaultRecord(kind, target, round(at, 1), round(down, 1))
        record.bus_whole_seconds = await self._bus_whole(restored)
        if kind == "remediator":
            record.next_alert_seconds = await self._next_alert(restored)
        record.next_placement_seconds = await self._first_after(self.placements, restored)
        record.next_relay_bytes_seconds = await self._first_after(self.metered, restored, 10.0)
        self.report.faults.append(record)

        print(f"[chaos] {json.dumps(asdict(record))}", file=sys.stderr)

    def _children(self) -> list[str]:
        assert self.system is not None
        return [c.name for c in self.system.children if c.process.poll() is None]

    def _target(self, kind: str) -> str:
        names_ = [n for n in self._children() if n.startswith(f"{kind}-")]
        return self.rng.choice(sorted(names_))

    async def _bus_whole(self, since: float, timeout: float = 60.0) -> float | None:
        assert self.client is not None
        probe = self.client.bus.bucket(names.BUCKET_HEALTH, NodeHealth)
        deadline = since + timeout
        while time.monotonic() < deadline:
            try:
                beat = NodeHealth(node="chaos-probe", healthy=True, heartbeat_time=_now())
                await probe.put("chaos-probe", beat)
                await probe.delete("chaos-probe")
                return round(time.monotonic() - since, 2)
            except Exception:
                await asyncio.sleep(0.1)
        return None

    async def _first_after(
        self, times: list[float], since: float, timeout: float = 60.0
    ) -> float | None:
        """Seconds from `since` to the first of `times` after it (None: none came)."""
        deadline = since + timeout
        while time.monotonic() < deadline:
            after = [t for t in times if t > since]
            if after:
                return round(min(after) - since, 2)
            await asyncio.sleep(0.2)
        return None

    async def _next_alert(self, since: float, timeout: float = 30.0) -> float | None:
        """A pending row remap on c-2 (one dcgm reading shows it) written after the remediator
        came back: until its alert is there; then cleared before its persistence window makes
        a recommendation."""
        assert self.system is not None and self.client is not None
        machine = self.system.machine_dir("c-2")
        faults.inject(machine, faults.Fault(kind="row-remap-pending"))
        bus = self.client.bus
        await bus.ensure_bucket(names.BUCKET_ALERTS)
        alerts = bus.bucket(names.BUCKET_ALERTS, Alert)
        try:
            deadline = since + timeout
            while time.monotonic() < deadline:
                found = await alerts.snapshot()
                if any(a.value.node == "c-2" and a.value.state is AlertState.FIRING
                       for a in found.values()):  # fmt: skip
                    return round(time.monotonic() - since, 2)
                await asyncio.sleep(0.1)
            return None
        finally:
            faults.clear(machine, "row-remap-pending")

    # -- what a client sees ----------------------------------------------------------------

    async def _observe(self) -> list[asyncio.Task[None]]:
        assert self.client is not None
        bus = self.client.bus

        async def on_event(msg: Any) -> None:
            ident = (msg.headers or {}).get("Nats-Msg-Id")
            if ident:
                self.events[ident] = msg.data

        await bus.nc.subscribe("nodus.evt.>", cb=on_event)

        async def on_usage(_: Any) -> None:
            self.metered.append(time.monotonic())

        await bus.nc.subscribe("nodus.usage.>", cb=on_usage)

        client = self.client

        async def epochs() -> None:
            async for change in client.epochs.watch():
                if change.value is not None and change.value.fenced:
                    self.fenced_seen.add(change.key)

        async def jobs() -> None:
            async for change in client.jobs.watch():
                placed = change.value.status.placed_time if change.value else None
                if placed is not None and self._placed.get(change.key) != placed:
                    self._placed[change.key] = placed
                    self.placements.append(time.monotonic())

        return [asyncio.create_task(epochs()), asyncio.create_task(jobs())]

    async def _settle(self, timeout: float = 0.0) -> None:
        """Every job applied ends (or the timeout passes); the repair finishes."""
        assert self.client is not None
        deadline = time.monotonic() + (timeout or SETTLE_SECONDS)
        while time.monotonic() < deadline:
            try:
                jobs = {j.metadata.name: j for j in await self.client.list_jobs()}
            except Exception:
                await asyncio.sleep(1)
                continue
            if all(n in jobs and jobs[n].status.phase in FINAL for n in self.applied) and (
                not self.repair or await self._repair_state() in TERMINAL_STATES
            ):
                break
            await asyncio.sleep(1)
        # Usage the relays metered last reaches the stream, and a bill it changes is amended
        # by the prober's next sweep.
        await asyncio.sleep(3 + LATE_USAGE_SWEEP_SECONDS)

    async def _repair_state(self) -> RemediationState | None:
        """The state of the repair in flight's latest remediation (None: none yet)."""
        assert self.client is not None
        bus = self.client.bus
        try:
            await bus.ensure_bucket(names.BUCKET_REMEDIATIONS)
            rems = await bus.bucket(names.BUCKET_REMEDIATIONS, Remediation).snapshot()
        except Exception:
            return None
        mine = [
            r.value
            for r in rems.values()
            if r.value.node == REPAIR_NODE and r.value.kind is AlertKind.READONLY_FILESYSTEM
        ]
        if not mine:
            return None
        return max(mine, key=lambda r: r.created_time).state

    # -- invariants ------------------------------------------------------------------------

    async def _check(self) -> None:
        assert self.client is not None
        bus = self.client.bus
        bad = self.report.violations
        jobs = {j.metadata.name: j for j in await self.client.list_jobs()}
        epochs = await self.client.epochs.snapshot()
        live: dict[str, list[Epoch]] = {}
        for item in epochs.values():
            if not item.value.fenced:
                live.setdefault(item.value.gang, []).append(item.value)
        for name in self.applied:
            found = jobs.get(name)
            if found is None:
                bad.append(f"job {name} was applied and is gone")
                continue
            phase = found.status.phase
            self.report.jobs[name] = phase.value
            gang = found.key
            if phase is Phase.RUNNING and len(live.get(gang, [])) != 1:
                bad.append(f"{name} Running with {len(live.get(gang, []))} live epochs")
            if phase not in FINAL:
                # Its work takes seconds: still going after the settling time, it is stuck.
                bad.append(f"{name} is {phase.value} {SETTLE_SECONDS:g} s after the faults")
            if phase in FINAL and live.get(gang):
                bad.append(f"{name} ended {phase.value} and epoch {live[gang][0].epoch} is live")
            if phase in FINAL and phase is not EXPECTED:
                bad.append(f"job {name} ended {phase.value}, not {EXPECTED.value}")
            if phase is Phase.SUCCEEDED:
                path = path_of(int(name.rsplit("-", 1)[1]), self.netns)
                self.report.succeeded[path] = self.report.succeeded.get(path, 0) + 1
        self._check_recovery()
        members: Counter[str] = Counter()
        for gang_epochs in live.values():
            for epoch in gang_epochs:
                members.update(m.node for m in epoch.members)
        bad += [f"machine {n} is in {c} live epochs" for n, c in members.items() if c > 1]
        leases = await bus.bucket(names.BUCKET_LEASES, Lease).snapshot()
        for node, lease in leases.items():
            current = [e.epoch for e in live.get(lease.value.gang, [])]
            if lease.value.epoch not in current:
                bad.append(
                    f"machine {node} is leased to {lease.value.gang} epoch {lease.value.epoch}, "
                    f"not a live epoch (live: {current})"
                )
        for key in sorted(self.fenced_seen):
            now_ = epochs.get(key)
            if now_ is not None and not now_.value.fenced:
                bad.append(f"epoch {key} was fenced and is live again")
        self._check_running()
        await self._check_repairs(bus)
        await self._check_billing(jobs)
        await self._check_events(bus, jobs)

    def _check_recovery(self) -> None:
        """Every fault's every recovery figure came (None: the system was not whole again)."""
        for fault in self.report.faults:
            figures = ["bus_whole_seconds", "next_placement_seconds", "next_relay_bytes_seconds"]
            if fault.kind == "remediator":
                figures.append("next_alert_seconds")
            for figure in figures:
                if getattr(fault, figure) is None:
                    self.report.violations.append(
                        f"fault {fault.kind} {fault.target} at {fault.at:g} s: no {figure}"
                    )

    def _check_running(self) -> None:
        """Every daemon killed came back: each one's latest process still runs at the end."""
        assert self.system is not None
        latest = {child.name: child for child in self.system.children}
        self.report.violations += [
            f"{name} did not come back after its restart (exited {child.process.returncode}; "
            f"see {child.log})"
            for name, child in sorted(latest.items())
            if child.process.poll() is not None
        ]

    async def _check_repairs(self, bus: Bus) -> None:
        bad = self.report.violations
        await bus.ensure_bucket(names.BUCKET_REMEDIATIONS)
        rems = await bus.bucket(names.BUCKET_REMEDIATIONS, Remediation).snapshot()
        self.report.remediations = len(rems)
        state = await self._repair_state()
        self.report.repair = state.value if state is not None else None
        if self.repair and state is not RemediationState.DONE:
            bad.append(
                f"the repair in flight on {REPAIR_NODE} ended "
                f"{state.value if state is not None else 'never started'}, not Done"
            )
        # Each fault may make one remediation: the read-only filesystem injected on h-3, and
        # an agent killed or paused (its machine may look unreachable for a moment).
        allowed: Counter[str] = Counter({"h-3": 1})
        for fault in self.report.faults:
            if fault.target.startswith("agent-"):
                allowed[fault.target.removeprefix("agent-")] += 1
        made: Counter[str] = Counter(r.value.node for r in rems.values())
        bad += [
            f"{node} had {count} remediations for {allowed[node]} faults"
            for node, count in made.items()
            if count > allowed[node]
        ]
        reboots: Counter[str] = Counter()
        for rem in rems.values():
            r = rem.value
            states = [t.state for t in r.history]
            repeated = [s.value for s, c in Counter(states).items() if c > 1]
            if repeated:
                bad.append(f"remediation {r.id} entered {', '.join(repeated)} twice")
            if (
                r.action in (Action.REBOOT, Action.POWER_CYCLE)
                and r.issued_time is not None
                and not r.issue_skipped
            ):
                reboots[r.node] += 1
        for node, issued in reboots.items():
            log = self.state / "logs" / f"agent-{node}.log"
            booted = log.read_text().count("restarting: the machine reboots")
            if booted != issued:
                bad.append(f"{node} booted {booted} times for {issued} reboots issued")

    async def _check_billing(self, jobs: dict[str, Job]) -> None:
        assert self.client is not None
        usage = await self.client.usage()
        for name in self.applied:
            found = jobs.get(name)
            if found is None:
                continue
            gang = found.status.gang
            if found.status.billing is None:
                if gang is not None and gang.transport is PathClass.RELAYED:
                    self.report.violations.append(f"{name}: Relayed and has no bill")
                continue
            billed = found.status.billing.mesh_relay_gi_b * GIB
            metered = float(usage.get(found.key, 0))
            if gang is not None and gang.transport is PathClass.DIRECT:
                # G17: a Direct pair's bytes through the relays (before its holes punched,
                # or a fallback) are metered, not billed.
                metered = 0.0
            if metered == 0 and billed == 0:
                continue
            if abs(billed - metered) > BILLING_TOLERANCE * max(metered, billed):
                self.report.violations.append(
                    f"{name}: billed {billed:.0f} relay bytes, the relays metered {metered:.0f}"
                )

    async def _check_events(self, bus: Bus, jobs: dict[str, Job]) -> None:
        self.report.events_seen = len(self.events)
        if not self.events:
            self.report.violations.append("a client saw no event")
        replayed = await bus.replay(names.EVENTS_STREAM, "nodus.evt.>")
        stored = {(msg.headers or {}).get("Nats-Msg-Id") for msg in replayed}
        subjects = {msg.subject for msg in replayed}
        for name in self.applied:
            found = jobs.get(name)
            if found is None or found.status.phase is not Phase.SUCCEEDED:
                continue
            lacking = [
                kind
                for kind in SUCCEEDED_EVENTS
                if names.job_event(found.key, kind) not in subjects
            ]
            if lacking:
                self.report.violations.append(
                    f"job {name} Succeeded without its events in {names.EVENTS_STREAM}: "
                    f"{', '.join(lacking)}"
                )
        missing = sorted(set(self.events) - stored)
        if missing:
            self.report.violations.append(
                f"{len(missing)} events a client saw are not in {names.EVENTS_STREAM}: "
                f"{missing[:5]}"
            )


def _now() -> datetime:
    return datetime.now(UTC)


def _interrupt(signum: int, frame: object) -> None:
    # Once: a second SIGTERM (`timeout` passes its own on) must not cut the stopping short.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--seed", type=int, action="append", help="repeatable; default: 10 random")
    parser.add_argument("--faults", type=int, default=len(KINDS))
    parser.add_argument(
        "--keep", type=Path, help="keep each failed run's state (logs included) under DIR/SEED"
    )
    args = parser.parse_args(argv)
    seeds = args.seed or [random.randrange(1 << 20) for _ in range(10)]
    # SIGTERM (a CI timeout, `kill`) unwinds like Ctrl-C: every run stops what it started.
    signal.signal(signal.SIGTERM, _interrupt)
    summary = []
    for seed in seeds:
        with tempfile.TemporaryDirectory(prefix=f"nodus-chaos-{seed}-") as state:
            chaos = Chaos(Path(state), seed, args.faults)
            try:
                report = asyncio.run(chaos.run())
            finally:
                chaos.stop()  # what an interrupted run left: processes, namespaces
            if report.violations and args.keep:
                shutil.copytree(state, args.keep / str(seed), dirs_exist_ok=True)
        print(json.dumps(asdict(report), indent=1), flush=True)
        summary.append({"seed": seed, "violations": len(report.violations), "s": report.seconds})
    print(json.dumps(summary))
    return 1 if any(s["violations"] for s in summary) else 0


if __name__ == "__main__":
    sys.exit(main())

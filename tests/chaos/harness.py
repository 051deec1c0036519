"""A bounded, seeded chaos run (issue 14), Jepsen-style: the real system (`LocalSystem` on a
three-server NATS cluster, two placer replicas, the runner, the remediator and its monitor,
two meshed relays, one agent per machine) runs jobs on the Private, Relayed and Direct paths
(Direct in the network-namespace lab, when this machine has it) while a repair is in flight,
and a seeded schedule, each kind twice, SIGKILLs and restarts a NATS server, a placer
replica, the runner, the remediator, a relay and an agent; pauses one process (SIGSTOP) for
longer than its heartbeat; pauses the agent of a running gang's member past the placer's
heartbeat timeout (the member is lost, the gang placed again); and makes two faults at once
(a relay and an agent, a NATS server and a placer). Afterwards it checks invariants, not timings:

- every job applied is final, or Running with exactly one live epoch;
- no machine is in two live epochs, and every lease names its job's live epoch;
- every epoch seen fenced stays fenced;
- each fault made at most one remediation, and each remediation ran each step once (its
  history never enters a state twice, its machine booted once per reboot);
- the mesh-relay bytes billed equal what the relays metered, within 0.1 %;
- every event of NODUS_EVENTS a client saw is in the stream afterwards.

Every job must Succeed, every apply be accepted, every fault's recovery be seen (a KV write
acknowledged, the next job placed, relay bytes after a relay's, an alert after the
remediator's), the repair in flight end Done, and no daemon log an error (tests/chaos/checks.py).

    python -m tests.chaos.harness --seed 7 [--faults 5]
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
import urllib.request
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from app.demo import lab_unavailable
from app.lab import faults
from app.local import LocalSystem
from libs.bus.server import NatsCluster
from libs.client.client import Client
from libs.contracts import names
from libs.contracts.fleet import NodeHealth
from libs.contracts.jobs import FINISHED_PHASES as FINAL
from libs.contracts.jobs import Phase
from libs.contracts.lifecycle import RankStatus
from libs.contracts.remediation import (
    TERMINAL_STATES,
    Action,
    Alert,
    AlertState,
    Policy,
)
from services.placer.config import DEFAULT_CONFIG as DEFAULT_PLACER_CONFIG
from services.runner.billing import SWEEP_SECONDS as LATE_USAGE_SWEEP_SECONDS
from tests.chaos.broken import DEFECT_VARIABLE
from tests.chaos.checks import (
    HEARTBEAT_TIMEOUT_SECONDS,
    LOSE_MEMBER_SECONDS,
    SETTLE_SECONDS,
    ChaosChecks,
    FaultRecord,
    Report,
)
from tests.chaos.workload import fleet, job, path_of
from tests.e2e.daemon_logs import DaemonLogs

# One process each: SIGKILLed and restarted, or (pause) SIGSTOPped for a while; lose-member
# pauses the agent of a gang's member past the placer's heartbeat timeout, so the member is
# lost and the gang placed again.
KINDS = ("nats", "placer", "runner", "remediator", "relay", "agent", "pause", "lose-member")
# Two faults at once.
PAIRS = ("relay+agent", "nats+placer")
HEARTBEAT_SECONDS = 1.0
MIN_JOBS = 6  # applied by every run, however few its faults: two of each path
APPLY_SECONDS = 3.0  # between two applies (a path queues at most QUEUED_PER_PATH)
QUEUED_PER_PATH = 2  # a path's jobs not ended yet before its next is applied
ALERT_PROBE_NODES = ("c-2", "c-1", "c-0")  # where a fault is written after a remediator's


class Chaos(ChaosChecks):
    def __init__(
        self,
        state: Path,
        seed: int,
        faults: int | None = None,
        netns: bool | None = None,
        kinds: tuple[str, ...] = KINDS + PAIRS,
        repair: bool = True,
        defect: str | None = None,
        min_jobs: int = MIN_JOBS,
    ) -> None:
        """Each kind of `kinds` twice, each pair once, in an order the seed draws; `faults`
        cuts the schedule short. `kinds`, `repair` (a repair in flight), `defect` (a daemon
        of a broken build, tests/chaos/broken.py) and fewer jobs (`min_jobs`) make the short
        runs of the harness's own tests."""
        self.min_jobs = min_jobs
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
        # When a relay's byte counter was seen to grow (its metrics, every 0.5 s): a relay
        # carries traffic. Usage records say only billed bytes, and an idle tunnel has none.
        self.relayed: list[float] = []
        self.restored: list[tuple[FaultRecord, float]] = []  # each fault, when it ended
        self._alert_probes = 0
        self._enough_jobs = asyncio.Event()  # min_jobs applies tried, refused ones included
        self._placed: dict[str, datetime] = {}
        self._phases: dict[str, Phase] = {}  # each job's phase, as a client's watch saw it
        self._phase_seen = asyncio.Event()
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
            placer_config=self._placer_config(),
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
            for kind in self._schedule():
                await asyncio.sleep(self.rng.uniform(0.5, 1.5))
                await self._fault(kind)
            await self._recovered()  # jobs go on being applied until each fault's next placement
            await self._enough_jobs.wait()  # a short run (the harness's own tests) too
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

    def _schedule(self) -> list[str]:
        singles = [k for k in self.kinds if "+" not in k]
        schedule = singles * 2 + [k for k in self.kinds if "+" in k]
        self.rng.shuffle(schedule)
        return schedule[: self.fault_count]

    def _placer_config(self) -> Path:
        settings = yaml.safe_load(DEFAULT_PLACER_CONFIG.read_text())
        settings["heartbeatTimeoutSeconds"] = HEARTBEAT_TIMEOUT_SECONDS
        path = self.state / "placer.yaml"
        path.write_text(yaml.safe_dump(settings))
        return path

    def _broken(self) -> dict[str, Any]:
        """The LocalSystem options that start the defect's daemon from the broken build."""
        if self.defect is None:
            return {}
        daemon = self.defect.split("-", 1)[0]  # runner-..., placer-..., relay-...
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
            # A path's next job waits while QUEUED_PER_PATH of its own have not ended: its
            # machines run one or two gangs, and a longer queue is only drained after the
            # faults, where it proves nothing and costs minutes.
            path = path_of(index, self.netns)
            while self._unfinished(path) >= QUEUED_PER_PATH:
                self._phase_seen.clear()
                await self._phase_seen.wait()
            try:
                await self.client.apply(job(index, self.netns))
                self.applied.append(f"chaos-{index}")
            except Exception as error:  # one server down must not refuse a client
                self.report.violations.append(
                    f"apply chaos-{index} refused or timed out: {type(error).__name__}: {error}"
                )
            index += 1
            if index >= self.min_jobs:
                self._enough_jobs.set()
            await asyncio.sleep(APPLY_SECONDS)

    def _unfinished(self, path: str) -> int:
        """Jobs of `path` applied and not yet ended (one not seen yet counts)."""
        return sum(
            1
            for name in self.applied
            if path_of(int(name.rsplit("-", 1)[1]), self.netns) == path
            and self._phases.get(f"acme.{name}") not in FINAL
        )

    # -- faults ------------------------------------------------------------------------------

    async def _fault(self, kind: str) -> None:
        """One fault, or two at once (a pair); the figures that need no waiting are taken now,
        the others once the faults are over (`_recovered`)."""
        at = time.monotonic() - self.started
        record = FaultRecord(kind, "", round(at, 1), 0.0)
        ends = await asyncio.gather(*(self._inflict(part, record) for part in kind.split("+")))
        record.target = "+".join(target for target, _ in ends)
        record.down_seconds = round(max(down for _, down in ends), 1)
        restored = time.monotonic()
        record.bus_whole_seconds = await self._bus_whole(restored)
        if "remediator" in kind.split("+"):
            record.next_alert_seconds = await self._next_alert(restored)
        self.report.faults.append(record)
        self.restored.append((record, restored))
        print(f"[chaos] {json.dumps(asdict(record))}", file=sys.stderr)

    async def _inflict(self, kind: str, record: FaultRecord) -> tuple[str, float]:
        """Kill (or pause) and bring back one process; (its name, how long it was down)."""
        system = self.system
        assert system is not None and isinstance(system.nats, NatsCluster)
        down = self.rng.uniform(1.0, 3.0)
        if kind == "nats":
            index = self.rng.randrange(len(system.nats.servers))
            system.nats.kill(index)
            await asyncio.sleep(down)
            await asyncio.to_thread(system.nats.restart, index)
            return f"nats-n{index}", down
        if kind == "lose-member":
            member = await self._silence_a_member()
            if member is None:
                self.report.violations.append("lose-member: no job ran for 30 s")
                return "nobody", 0.0
            node, record.gang, record.epoch, record.silenced_time = member
            target = f"agent-{node}"
            await asyncio.sleep(LOSE_MEMBER_SECONDS)
            os.kill(system.child(target).process.pid, signal.SIGCONT)
            return target, LOSE_MEMBER_SECONDS
        if kind == "pause":
            target = self.rng.choice(self._children())
            down = max(down, HEARTBEAT_SECONDS * 4)  # longer than its heartbeat
            pid = system.child(target).process.pid
            os.kill(pid, signal.SIGSTOP)
            await asyncio.sleep(down)
            os.kill(pid, signal.SIGCONT)
            return target, down
        target = self._target(kind)
        child = system.child(target)
        os.killpg(child.process.pid, signal.SIGKILL)
        child.process.wait()
        await asyncio.sleep(down)
        system.restart(target)
        return target, down

    async def _silence_a_member(self, timeout: float = 30.0) -> tuple[str, str, int, float] | None:
        """SIGSTOP the agent of a member whose rank still runs once its agent is stopped: a
        rank that exited between the choice and the stop was reported (chaos seed 1 in CI),
        its job could end before the member was due to be lost, and another is chosen. A
        read can still lag the exit (a replica behind its leader): the check then finds the
        job ended before the member was due to be lost, and owes no later epoch.
        (node, gang, epoch, when the agent was stopped)."""
        assert self.system is not None and self.client is not None
        await self.client.bus.ensure_bucket(names.BUCKET_RANKS)
        ranks = self.client.bus.bucket(names.BUCKET_RANKS, RankStatus)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            member = await self._member_to_lose(deadline - time.monotonic())
            if member is None:
                return None
            node, gang, epoch = member
            pid = self.system.child(f"agent-{node}").process.pid
            os.kill(pid, signal.SIGSTOP)
            stopped = time.time()
            records = await ranks.snapshot(f"{gang}.{epoch}.>")
            if any(r.value.node == node and r.value.state == "Running" for r in records.values()):
                return node, gang, epoch, stopped
            os.kill(pid, signal.SIGCONT)
        return None

    async def _member_to_lose(self, timeout: float = 30.0) -> tuple[str, str, int] | None:
        """A member of a gang being probed or run whose rank has not exited (so its job cannot
        end while its agent is silent): (node, gang, epoch)."""
        assert self.client is not None
        await self.client.bus.ensure_bucket(names.BUCKET_RANKS)
        ranks = self.client.bus.bucket(names.BUCKET_RANKS, RankStatus)
        alive = set(self._children())
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            candidates = []
            for found in await self.client.list_jobs():
                status = found.status
                if status.phase not in (Phase.PROBING, Phase.RUNNING) or status.gang is None:
                    continue
                records = await ranks.snapshot(f"{found.key}.{status.epoch}.>")
                exited = {r.value.node for r in records.values() if r.value.state != "Running"}
                candidates += [
                    (m.node, found.key, status.epoch)
                    for m in status.gang.members
                    if m.node not in exited and f"agent-{m.node}" in alive
                ]
            if candidates:
                return self.rng.choice(sorted(candidates))
            await asyncio.sleep(0.5)
        return None

    async def _recovered(self, placement_within: float = 60.0, bytes_within: float = 30.0) -> None:
        """Each fault's next placement (and, after a relay's, the next relay bytes metered),
        waited for while jobs go on being applied; None when none came in time."""
        for record, restored in self.restored:
            record.next_placement_seconds = await self._first_after(
                self.placements, restored, restored + placement_within - time.monotonic()
            )
            if "relay" in record.kind.split("+"):
                # Relayed bytes flow only while a Relayed job runs: every third job applied is one.
                record.next_relay_bytes_seconds = await self._first_after(
                    self.relayed, restored, restored + bytes_within - time.monotonic()
                )

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
        deadline = time.monotonic() + timeout
        while True:
            after = [t for t in times if t > since]
            if after:
                return round(min(after) - since, 2)
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(0.2)

    async def _next_alert(self, since: float, timeout: float = 30.0) -> float | None:
        """A pending row remap (one dcgm reading shows it) written after the remediator came
        back: until its alert is there; then cleared before its persistence window makes a
        recommendation. Each time on another machine: one that flapped keeps its window (R13),
        and a second alert there would rightly be repaired."""
        assert self.system is not None and self.client is not None
        node = ALERT_PROBE_NODES[self._alert_probes % len(ALERT_PROBE_NODES)]
        self._alert_probes += 1
        machine = self.system.machine_dir(node)
        faults.inject(machine, faults.Fault(kind="row-remap-pending"))
        bus = self.client.bus
        await bus.ensure_bucket(names.BUCKET_ALERTS)
        alerts = bus.bucket(names.BUCKET_ALERTS, Alert)
        try:
            deadline = since + timeout
            while time.monotonic() < deadline:
                found = await alerts.snapshot()
                if any(a.value.node == node and a.value.state is AlertState.FIRING
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

        client = self.client

        async def epochs() -> None:
            async for change in client.epochs.watch():
                if change.value is not None and change.value.fenced:
                    self.fenced_seen.add(change.key)

        async def jobs() -> None:
            """Each job's phase and placements, read every half second rather than watched: a
            watch's consumer lost with a server (CI, seed 1) left the harness waiting for
            phases that never came, and it stopped applying jobs."""
            while True:
                try:
                    found = await client.list_jobs()
                except Exception:  # a server failing over: read again
                    await asyncio.sleep(0.5)
                    continue
                for record in found:
                    key, status = record.key, record.status
                    self._phases[key] = status.phase
                    placed = status.placed_time
                    if placed is not None and self._placed.get(key) != placed:
                        self._placed[key] = placed
                        # When the placer says it placed it, on this process's clock.
                        ago = (datetime.now(UTC) - placed).total_seconds()
                        self.placements.append(time.monotonic() - max(ago, 0.0))
                self._phase_seen.set()
                await asyncio.sleep(0.5)

        return [
            asyncio.create_task(epochs()),
            asyncio.create_task(jobs()),
            asyncio.create_task(self._watch_relay_bytes()),
        ]

    async def _watch_relay_bytes(self) -> None:
        """Note each time a relay's `nodus_relay_bytes_total` grew (a restarted relay starts
        again from zero: its first count is its baseline)."""
        assert self.system is not None
        last: dict[str, float] = {}
        while True:
            for name in list(self.system.metrics_ports):
                url = self.system.metrics_url(name) if name.startswith("relay-") else None
                if url is None:
                    continue
                total = await asyncio.to_thread(_relay_bytes, url)
                if total is None:
                    continue
                if name in last and total > last[name]:
                    self.relayed.append(time.monotonic())
                last[name] = total
            await asyncio.sleep(0.5)

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
        # by the runner's next sweep.
        await asyncio.sleep(3 + LATE_USAGE_SWEEP_SECONDS)


def _now() -> datetime:
    return datetime.now(UTC)


def _interrupt(signum: int, frame: object) -> None:
    # Once: a second SIGTERM (`timeout` passes its own on) must not cut the stopping short.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--seed", type=int, action="append", help="repeatable; default: 10 random")
    parser.add_argument("--faults", type=int, help="cut the schedule short")
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


def _relay_bytes(url: str) -> float | None:
    """The sum of a relay's `nodus_relay_bytes_total`, or None when it does not answer."""
    try:
        with urllib.request.urlopen(url, timeout=2.0) as answer:
            text = answer.read().decode()
    except OSError:
        return None
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("nodus_relay_bytes_total{")
    )

"""What a chaos run checks afterwards (tests/chaos/harness.py): the invariants, each fault's
recovery, and where a job that did not end stands. A mixin of `Chaos`, which holds the run's
state declared here."""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from app.local import LocalSystem
from libs.bus import Bus
from libs.client.client import Client
from libs.contracts import names
from libs.contracts.epochs import Epoch, Lease
from libs.contracts.jobs import FINISHED_PHASES as FINAL
from libs.contracts.jobs import Job, PathClass, Phase
from libs.contracts.lifecycle import RankStatus
from libs.contracts.remediation import (
    Action,
    AlertKind,
    Remediation,
    RemediationState,
)
from tests.chaos.workload import EXPECTED, REPAIR_NODE, SUCCEEDED_EVENTS, path_of

HEARTBEAT_TIMEOUT_SECONDS = 5.0  # the placer's, lowered from 15 s so a run sees members lost
LOSE_MEMBER_SECONDS = HEARTBEAT_TIMEOUT_SECONDS + 3.0
BILLING_TOLERANCE = 0.001
EVENTS_SETTLE_SECONDS = 10  # for an event seen as it was published to be stored, a leader elected
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
    next_relay_bytes_seconds: float | None = None  # bytes through a relay after it
    next_alert_seconds: float | None = None  # after a remediator restart: a new fault alerted
    # lose-member: the job and epoch whose member was paused, and whether a later epoch came
    gang: str | None = None
    epoch: int | None = None
    placed_again: bool | None = None
    silenced_time: float | None = None  # time.time() its agent was stopped
    # The job ended on its own before the member was due to be lost (its ranks' exits were
    # reported just before the stop): no later epoch is owed.
    ended_first: bool | None = None


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


class ChaosChecks:
    state: Path
    repair: bool
    netns: bool
    system: LocalSystem | None
    client: Client | None
    applied: list[str]
    fenced_seen: set[str]
    events: dict[str, bytes]
    report: Report

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
                where = await self._stuck_at(found)
                bad.append(
                    f"{name} is {phase.value} {SETTLE_SECONDS:g} s after the faults ({where})"
                )
            if phase in FINAL and live.get(gang):
                bad.append(f"{name} ended {phase.value} and epoch {live[gang][0].epoch} is live")
            if phase in FINAL and phase is not EXPECTED:
                where = await self._stuck_at(found)
                bad.append(f"job {name} ended {phase.value}, not {EXPECTED.value} ({where})")
            if phase is Phase.SUCCEEDED:
                path = path_of(int(name.rsplit("-", 1)[1]), self.netns)
                self.report.succeeded[path] = self.report.succeeded.get(path, 0) + 1
        self._check_recovery()
        self._check_members_lost(jobs)
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

    async def _stuck_at(self, job: Job) -> str:
        """Where a job that did not end well stands: its status, its ranks and their logs'
        ends, so a CI log says where to look."""
        assert self.client is not None and self.system is not None
        status = job.status
        said = [f"epoch {status.epoch}"]
        said += [f"{c.type} {c.status} {c.reason}: {c.message}" for c in status.conditions]
        if status.phase is Phase.PENDING:
            for placer in sorted(
                c.name for c in self.system.children if c.name.startswith("placer-")
            ):
                said += self._daemon_lines(placer, job.key)
            return "; ".join(said)
        await self.client.bus.ensure_bucket(names.BUCKET_RANKS)
        ranks = await self.client.bus.bucket(names.BUCKET_RANKS, RankStatus).snapshot(
            f"{job.key}.{status.epoch}.>"
        )
        for rank in sorted(ranks.values(), key=lambda r: r.value.rank):
            r = rank.value
            said.append(f"rank {r.rank} on {r.node} {r.state} (exit {r.exit_code})")
            log = Path(r.log) if r.log else None
            if log is not None and log.is_file():
                tail = log.read_text(errors="replace").strip().splitlines()[-2:]
                said.append(f"its log ends: {' | '.join(tail)}")
            said += self._daemon_lines(f"agent-{r.node}", job.key)
        for relay in sorted(c.name for c in self.system.children if c.name.startswith("relay-")):
            said += self._daemon_lines(relay, job.key)
        return "; ".join(said)

    def _daemon_lines(self, daemon: str, gang: str, count: int = 4) -> list[str]:
        """The last lines of a daemon's log that name the gang."""
        log = self.state / "logs" / f"{daemon}.log"
        if not log.is_file():
            return []
        lines = [line for line in log.read_text(errors="replace").splitlines() if gang in line]
        return [f"{daemon}: {line[-300:]}" for line in lines[-count:]]

    def _check_recovery(self) -> None:
        """Every fault's every recovery figure came (None: the system was not whole again)."""
        for fault in self.report.faults:
            figures = ["bus_whole_seconds", "next_placement_seconds"]
            if "relay" in fault.kind.split("+"):
                figures.append("next_relay_bytes_seconds")
            if "remediator" in fault.kind.split("+"):
                figures.append("next_alert_seconds")
            for figure in figures:
                if getattr(fault, figure) is None:
                    self.report.violations.append(
                        f"fault {fault.kind} {fault.target} at {fault.at:g} s: no {figure}"
                    )

    def _check_members_lost(self, jobs: dict[str, Job]) -> None:
        """A member whose agent was silent past the heartbeat timeout was lost: its gang's
        epoch ended and a later one was placed."""
        by_key = {job.key: job for job in jobs.values()}
        for fault in self.report.faults:
            if fault.gang is None or fault.epoch is None:
                continue
            found = by_key.get(fault.gang)
            fault.placed_again = found is not None and found.status.epoch > fault.epoch
            fault.ended_first = found is not None and ended_before_lost(found, fault)
            if not fault.placed_again and not fault.ended_first:
                self.report.violations.append(
                    f"{fault.target} was silent {LOSE_MEMBER_SECONDS:g} s, past the "
                    f"{HEARTBEAT_TIMEOUT_SECONDS:g}-s heartbeat timeout, while a member of "
                    f"{fault.gang} epoch {fault.epoch}: no later epoch was placed (now "
                    f"{found.status.epoch if found else 'gone'})"
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
            for target in fault.target.split("+"):
                if target.startswith("agent-"):
                    allowed[target.removeprefix("agent-")] += 1
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
        seen = set(self.events)
        missing = sorted(seen - stored)
        for _ in range(EVENTS_SETTLE_SECONDS):
            if not missing:
                break
            # Seen as it was published, and perhaps not stored yet: its publisher tries again
            # while the stream elects a leader. Lost is still missing after the settle time.
            await asyncio.sleep(1.0)
            replayed = await bus.replay(names.EVENTS_STREAM, "nodus.evt.>")
            stored = {(msg.headers or {}).get("Nats-Msg-Id") for msg in replayed}
            missing = sorted(seen - stored)
        if missing:
            self.report.violations.append(
                f"{len(missing)} events a client saw are not in {names.EVENTS_STREAM}: "
                f"{missing[:5]}"
            )


def ended_before_lost(job: Job, fault: FaultRecord) -> bool:
    """The job's epoch of the fault ended on its own before the placer could have judged the
    silent member lost (the heartbeat timeout after the stop)."""
    status = job.status
    finished = status.finished_time
    if status.epoch != fault.epoch or finished is None or fault.silenced_time is None:
        return False
    return finished.timestamp() < fault.silenced_time + HEARTBEAT_TIMEOUT_SECONDS

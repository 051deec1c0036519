"""Node repair on a real nats-server (R1-R16): faults written in their real formats into each
machine's files, the monitor scanning them, the remediator deciding and repairing through the
local machine provider and in-process agents, and the audit trail of every step."""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import msgspec
import pytest

from libs.bus import Bus
from libs.bus.server import NatsServer
from libs.contracts import names
from libs.contracts.base import decode, now
from libs.contracts.epochs import Lease
from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.remediation import (
    Action,
    Alert,
    AlertKind,
    AlertState,
    ApproveRequest,
    Breaker,
    BreakerReply,
    BreakerResetRequest,
    CancelRequest,
    Cordon,
    CordonHold,
    Evidence,
    HostRecord,
    IdleWait,
    Ladder,
    MachineState,
    Outcome,
    Policy,
    RebootRequest,
    RemediationReply,
    RemediationState,
    RepairRequest,
    XidConsent,
)
from tests.conftest import StartPlacer
from tests.remediation_support import Fleet


@pytest.fixture
async def fleet(nats_server: NatsServer, bus: Bus, tmp_path: Path) -> AsyncIterator[Fleet]:
    for name in names.REMEDIATION_BUCKETS:
        await bus.ensure_bucket(name)
    started = Fleet(nats_server.url, bus, tmp_path / "state")
    yield started
    await started.stop()


async def approve(bus: Bus, ident: str, who: str = "alice") -> RemediationReply:
    return await bus.request(
        names.API_REMEDIATION_APPROVE, ApproveRequest(id=ident, approver=who), RemediationReply
    )


# -- S1, S3: signals that name another node, malformed records -----------------------------------


async def test_forged_and_malformed_signals_are_dropped(fleet: Fleet) -> None:
    from libs.contracts.remediation import SignalReport
    from services.remediator import metrics

    await fleet.add_machines(["gpu-a", "gpu-b"], pool="h100", cluster="c1")
    remediator = await fleet.start_remediator()
    before = _count(metrics.SIGNALS_DROPPED.labels("wrong_node"))
    forged = SignalReport(node="gpu-b", source="npd", observed_time=now(), findings=[])
    signals = fleet.bus.bucket(names.BUCKET_SIGNALS, SignalReport)
    await signals.put("gpu-a.npd", forged)  # gpu-a's key, gpu-b's name: refused (S1)
    kv = await fleet.bus.js.key_value(names.BUCKET_SIGNALS)
    await kv.put("gpu-a.kmsg", b"\x00not json{")  # S3: skipped and counted, never fatal

    async def dropped() -> bool:
        return _count(metrics.SIGNALS_DROPPED.labels("wrong_node")) > before

    await fleet.until(dropped, scan=False)
    # the remediator still works
    fleet.inject("gpu-a", "readonly-fs")

    async def fired() -> bool:
        return any(a.node == "gpu-a" for a in (await fleet.alerts()).values())

    await fleet.until(fired)
    assert not any(a.node == "gpu-b" for a in (await fleet.alerts()).values())
    assert remediator.replica == "r1"


# -- R1, R2, R3, R4, R5 (default), R13 persistence ---------------------------------------------


async def test_an_xid_becomes_an_alert_with_evidence_then_a_recommendation(fleet: Fleet) -> None:
    await fleet.add_machines(["gpu-a", "gpu-b"], pool="h100", cluster="c1")
    await fleet.start_remediator()
    written = fleet.inject("gpu-a", "xid", xid=79, gpu=2)
    alert_id = "gpu-a.xid-79.0000-3a-00"

    async def alert_fired() -> bool:
        return alert_id in await fleet.alerts()

    events = await fleet.bus.js.subscribe("nodus.evt.alert.>", ordered_consumer=True)
    await fleet.until(alert_fired)
    alert = (await fleet.alerts())[alert_id]
    assert alert.summary == "Xid 79 (GPU has fallen off the bus) on GPU 0000:3a:00 on gpu-a"
    assert "power cycled" in alert.description
    assert (alert.cluster, alert.pool, alert.severity) == ("c1", "h100", "critical")
    [evidence] = alert.evidence
    assert evidence.source == "kmsg" and evidence.where.endswith("machines/gpu-a/kmsg")
    assert evidence.lines == [written.split(": ", 1)[1]]
    assert evidence.labels["pci"] == "0000:3a:00" and evidence.xid == 79
    # the notification carries the same record as the API and the CLI
    message = await events.next_msg(timeout=5)
    assert decode(message.data, Alert).summary == alert.summary
    # not persisted for its window yet: no recommendation
    assert await fleet.recommendations() == {}
    fleet.clock.advance(seconds=61)

    async def recommended() -> bool:
        return alert_id in await fleet.recommendations()

    await fleet.until(recommended)
    rec = (await fleet.recommendations())[alert_id]
    assert rec.action is Action.POWER_CYCLE and "Xid 79 -> PowerCycle" in rec.rule
    # default policy: a person approves; nothing is repaired meanwhile
    pending = await fleet.remediation_in("gpu-a", RemediationState.PENDING)
    assert pending.requester.kind == "automatic" and pending.approver is None
    assert pending.evidence == alert.evidence
    assert "ApproveBeforeRepair" in pending.reason
    assert fleet.executed == []


async def test_each_detector_fires_its_alert(fleet: Fleet) -> None:
    await fleet.add_machines(["gpu-a"], pool="h100", cluster="c1")
    await fleet.start_remediator()
    injected: list[tuple[str, dict[str, Any]]] = [
        ("gpu-off-bus", {"gpu": 1}),
        ("ecc-dbe", {"gpu": 0}),
        ("row-remap-failure", {"gpu": 1}),
        ("thermal", {"gpu": 0}),
        ("readonly-fs", {}),
        ("ib-down", {"port": "mlx5_0/1"}),
        ("unreachable", {}),
    ]
    for kind, options in injected:
        fleet.inject("gpu-a", kind, **options)
    expected = {
        AlertKind.GPU_OFF_BUS,
        AlertKind.ECC_DOUBLE_BIT,
        AlertKind.ROW_REMAP_FAILURE,
        AlertKind.THERMAL_THROTTLING,
        AlertKind.READONLY_FILESYSTEM,
        AlertKind.INFINIBAND_PORT_DOWN,
        AlertKind.HOST_UNREACHABLE,
    }

    async def all_fired() -> bool:
        return expected <= {a.kind for a in (await fleet.alerts()).values()}

    await fleet.until(all_fired)
    for alert in (await fleet.alerts()).values():
        assert alert.summary and alert.description and alert.evidence
        assert alert.evidence[0].lines or alert.evidence[0].values


async def test_not_ready_alone_never_repairs(fleet: Fleet) -> None:
    await fleet.add_machines(["gpu-a"], pool="h100", cluster="c1")
    assert fleet.monitor is not None
    fleet.monitor.heartbeat_timeout = timedelta(seconds=0.5)
    fleet.monitor.reachability = False
    await fleet.set_policy(Policy(mode="Automatic", trusted_actions=list(Action)))
    await fleet.start_remediator()
    await fleet.agents["gpu-a"].stop()  # heartbeats stop: NotReady
    fleet.monitor._started -= timedelta(seconds=5)

    async def not_ready() -> bool:
        return any(a.kind is AlertKind.NODE_NOT_READY for a in (await fleet.alerts()).values())

    await fleet.until(not_ready, timeout=15)
    fleet.clock.advance(hours=5)
    await fleet.scan()
    assert await fleet.recommendations() == {}
    assert await fleet.remediations() == []
    await fleet.agents["gpu-a"].start()


# -- R5, R6, R7, R9 (reboot), R13 (cordon), R15 (revalidation) --------------------------------


async def test_approved_reboot_waits_for_idle_repairs_revalidates_and_rejoins(
    fleet: Fleet,
) -> None:
    await fleet.add_machines(["gpu-a", "gpu-b"], pool="h100", cluster="c1")
    await fleet.start_remediator()
    boot_before = fleet.agents["gpu-a"].boot_id
    fleet.inject("gpu-a", "xid", xid=48)
    await fleet.until(lambda: _has_alerts(fleet, 1))
    leases = fleet.bus.bucket(names.BUCKET_LEASES, Lease)
    await leases.put("gpu-a", Lease(gang="acme.train", epoch=1, placer="p", created_time=now()))
    fleet.clock.advance(seconds=61)
    pending = await fleet.remediation_in("gpu-a", RemediationState.PENDING)
    assert pending.action is Action.REBOOT
    reply = await approve(fleet.bus, pending.id)
    assert reply.remediation.approver is not None
    waiting = await fleet.remediation_in("gpu-a", RemediationState.WAITING_IDLE)
    assert "acme.train" in waiting.reason or "idle" in waiting.reason
    assert waiting.idle_deadline_time is not None
    cordon = await fleet.bus.bucket(names.BUCKET_CORDONS, Cordon).get("gpu-a")
    assert cordon is not None and cordon.value.holds["remediator"].remediation_id == pending.id
    # the gang ends: the node is idle and the reboot runs
    await leases.delete("gpu-a")
    done = await fleet.remediation_in("gpu-a", RemediationState.DONE)
    assert fleet.agents["gpu-a"].boot_id != boot_before
    assert [(n, a) for n, a, _ in fleet.executed] == [("gpu-a", Action.REBOOT)]
    # the audit trail (R7)
    assert done.requester.kind == "automatic"
    assert done.approver is not None and done.approver.kind == "human"
    assert done.approver.name == "alice"
    assert done.rule.startswith("Xid 48 -> Reboot")
    assert done.created_time <= done.approved_time <= done.started_time <= done.finished_time  # type: ignore[operator]
    assert [h.state for h in done.history] == [
        RemediationState.PENDING,
        RemediationState.APPROVED,
        RemediationState.WAITING_IDLE,
        RemediationState.RUNNING,
        RemediationState.REVALIDATING,
        RemediationState.DONE,
    ]
    assert done.outcome is Outcome.DONE and done.diagnostics == []
    # the reboot started the kernel log over; the alert clears, the cordon is lifted
    assert "Xid" not in (fleet.machine_dir("gpu-a") / "kmsg").read_text()

    async def lifted() -> bool:
        found = await fleet.bus.bucket(names.BUCKET_CORDONS, Cordon).get("gpu-a")
        return found is not None and not found.value.holds

    await fleet.until(lifted)

    async def resolved() -> bool:
        alerts = await fleet.alerts()
        return all(a.state is AlertState.RESOLVED for a in alerts.values())

    await fleet.until(resolved)
    assert await fleet.recommendations() == {}


async def test_idle_wait_max_then_interrupts_and_restarts_the_gang(fleet: Fleet) -> None:
    """R6: the max wait (2 h by default) runs out; R16: the gang on the node goes back to
    placement without it, for a new epoch."""
    from libs.contracts.jobs import ConditionType, Job, Phase
    from tests.factories import job

    await fleet.add_machines(["gpu-a"], pool="h100", cluster="c1")
    await fleet.set_policy(Policy(mode="Automatic", trusted_actions=[Action.REBOOT]))
    await fleet.start_remediator()
    running = job("train", "acme")
    running.status.phase = Phase.RUNNING
    running.status.epoch = 3
    jobs = fleet.bus.bucket(names.BUCKET_JOBS, Job)
    await jobs.put(running.key, running)
    leases = fleet.bus.bucket(names.BUCKET_LEASES, Lease)
    await leases.put("gpu-a", Lease(gang="acme.train", epoch=3, placer="p", created_time=now()))
    fleet.inject("gpu-a", "readonly-fs")
    await fleet.until(lambda: _has_alerts(fleet, 1))
    fleet.clock.advance(seconds=61)
    waiting = await fleet.remediation_in("gpu-a", RemediationState.WAITING_IDLE)
    assert waiting.idle_deadline_time is not None
    assert waiting.idle_deadline_time - waiting.wait_start_time == timedelta(hours=2)  # type: ignore[operator]
    fleet.clock.advance(hours=1)
    await fleet.scan()
    assert (await fleet.remediations("gpu-a"))[-1].state is RemediationState.WAITING_IDLE
    fleet.clock.advance(hours=1, seconds=1)
    done = await fleet.remediation_in("gpu-a", RemediationState.DONE)
    assert done.interrupted == ["acme.train"]
    restarted = await jobs.get("acme.train")
    assert restarted is not None and restarted.value.status.phase is Phase.PENDING
    assert "gpu-a" in restarted.value.status.avoid
    ready = restarted.value.condition(ConditionType.GANG_READY)
    assert ready is not None and ready.reason == "NodeRepair"


async def test_never_interrupt_waits_without_limit(fleet: Fleet) -> None:
    await fleet.add_machines(["gpu-a"], pool="h100", cluster="c1")
    await fleet.set_policy(
        Policy(
            mode="Automatic",
            trusted_actions=[Action.REBOOT],
            idle=IdleWait(never_interrupt=True),
        )
    )
    await fleet.start_remediator()
    leases = fleet.bus.bucket(names.BUCKET_LEASES, Lease)
    await leases.put("gpu-a", Lease(gang="acme.train", epoch=1, placer="p", created_time=now()))
    fleet.inject("gpu-a", "ecc-dbe")
    await fleet.until(lambda: _has_alerts(fleet, 1))
    fleet.clock.advance(seconds=61)
    waiting = await fleet.remediation_in("gpu-a", RemediationState.WAITING_IDLE)
    assert waiting.idle_deadline_time is None and waiting.never_interrupt
    fleet.clock.advance(days=30)
    await fleet.scan()
    await fleet.scan()
    assert (await fleet.remediations("gpu-a"))[-1].state is RemediationState.WAITING_IDLE
    assert fleet.executed == []


# -- R5 consent per Xid ------------------------------------------------------------------------


async def test_consent_per_xid_code(fleet: Fleet) -> None:
    await fleet.add_machines(["gpu-a", "gpu-b"], pool="h100", cluster="c1")
    await fleet.set_policy(Policy(xid_consent={119: XidConsent(auto=[Action.REBOOT])}))
    await fleet.start_remediator()
    fleet.inject("gpu-a", "xid", xid=119)
    fleet.inject("gpu-b", "xid", xid=48)
    await fleet.until(lambda: _has_alerts(fleet, 2))
    fleet.clock.advance(seconds=61)
    auto = await fleet.remediation_in("gpu-a", RemediationState.DONE)
    assert auto.approver is not None and auto.approver.kind == "policy"
    assert "Xid 119" in auto.approver.rule
    person = await fleet.remediation_in("gpu-b", RemediationState.PENDING)
    assert person.approver is None


# -- R13: the recommendation disappears with its alert; cooldown --------------------------------


async def test_recommendation_disappears_when_the_alert_clears(fleet: Fleet) -> None:
    await fleet.add_machines(["gpu-a"], pool="h100", cluster="c1")
    await fleet.start_remediator()
    fleet.inject("gpu-a", "readonly-fs")
    await fleet.until(lambda: _has_alerts(fleet, 1))
    fleet.clock.advance(seconds=61)
    pending = await fleet.remediation_in("gpu-a", RemediationState.PENDING)
    faults_clear(fleet, "gpu-a", "readonly-fs")
    cancelled = await fleet.remediation_in("gpu-a", RemediationState.CANCELLED)
    assert cancelled.id == pending.id and cancelled.outcome is Outcome.SELF_RESOLVED

    async def gone() -> bool:
        return await fleet.recommendations() == {}

    await fleet.until(gone)
    assert fleet.executed == []


async def test_cooldown_after_a_repair(fleet: Fleet) -> None:
    await fleet.add_machines(["gpu-a"], pool="h100", cluster="c1")
    await fleet.set_policy(Policy(mode="Automatic", trusted_actions=[Action.REBOOT]))
    await fleet.start_remediator()
    fleet.inject("gpu-a", "readonly-fs")
    await fleet.until(lambda: _has_alerts(fleet, 1))
    fleet.clock.advance(seconds=61)
    first = await fleet.remediation_in("gpu-a", RemediationState.DONE)
    # the fault comes back at once
    fleet.inject("gpu-a", "readonly-fs")
    fleet.clock.advance(seconds=61)

    async def second_waits() -> bool:
        rems = await fleet.remediations("gpu-a")
        return len(rems) == 2 and "cooldown" in rems[-1].reason

    await fleet.until(second_waits)
    assert len(fleet.executed) == 1
    fleet.clock.advance(minutes=31)

    async def both_done() -> bool:
        rems = await fleet.remediations("gpu-a")
        return [r.state for r in rems] == [RemediationState.DONE] * 2

    await fleet.until(both_done)
    second = (await fleet.remediations("gpu-a"))[-1]
    assert second.id != first.id and len(fleet.executed) == 2
    assert second.started_time is not None and first.finished_time is not None
    assert second.started_time - first.finished_time >= timedelta(minutes=30)


# -- R10: the ladder; R11 migrate without critical evidence -------------------------------------


async def test_a_fault_that_keeps_coming_back_climbs_the_ladder(fleet: Fleet) -> None:
    await fleet.add_machines(["gpu-a"], pool="h100", cluster="c1")
    await fleet.set_policy(
        Policy(mode="Automatic", trusted_actions=[Action.REBOOT, Action.REPROVISION])
    )
    await fleet.start_remediator()
    fleet.inject("gpu-a", "xid", xid=48, sticky=True)  # hardware: comes back after a reboot
    await fleet.until(lambda: _firing(fleet, 1))
    for attempt in range(3):
        fleet.clock.advance(minutes=31)  # past the cooldown and the persistence window

        async def ended(count: int = attempt + 1) -> bool:
            rems = await fleet.remediations("gpu-a")
            return len(rems) == count and not rems[-1].active

        await fleet.until(ended, timeout=15)
    rems = await fleet.remediations("gpu-a")
    actions = [r.action for r in rems]
    assert all(r.state is RemediationState.FAILED and r.diagnostics for r in rems)
    assert actions[:2] == [Action.REBOOT, Action.REBOOT]
    rems = await fleet.remediations("gpu-a")
    assert [r.action for r in rems] == [Action.REBOOT, Action.REBOOT, Action.REPROVISION]
    assert "one rung up to Reprovision" in rems[-1].rule
    ladder = await fleet.bus.bucket(names.BUCKET_LADDERS, Ladder).get(rems[0].ladder_key)
    assert ladder is not None and len(ladder.value.attempts) == 3
    # the failed node stayed cordoned between the attempts
    cordon = await fleet.bus.bucket(names.BUCKET_CORDONS, Cordon).get("gpu-a")
    assert cordon is not None and "remediator" in cordon.value.holds


async def test_migrate_without_critical_evidence_runs_as_reprovision(fleet: Fleet) -> None:
    await fleet.add_machines(["gpu-a"], pool="h100", cluster="c1")
    await fleet.set_policy(
        Policy(mode="Automatic", trusted_actions=[Action.MIGRATE, Action.REPROVISION])
    )
    await fleet.start_remediator()
    (fleet.machine_dir("gpu-a") / "scratch.dat").write_text("local data")
    fleet.inject("gpu-a", "thermal")  # warning only
    await fleet.until(lambda: _has_alerts(fleet, 1))
    fleet.clock.advance(seconds=61)
    ended = await fleet.remediation_in("gpu-a", RemediationState.DONE, RemediationState.FAILED)
    assert ended.requested_action is Action.MIGRATE and ended.action is Action.REPROVISION
    assert "R11" in ended.rule
    assert not (fleet.machine_dir("gpu-a") / "scratch.dat").exists()  # local data is lost
    state = await fleet.bus.bucket(names.BUCKET_MACHINES, MachineState).get("gpu-a")
    assert state is not None and state.value.host_id == "host-gpu-a"  # same host
    # the host's cooling is still bad: diagnostics fail after the reprovision
    assert ended.state is RemediationState.FAILED


async def test_migrate_with_critical_evidence_moves_host_and_revalidates_the_old_one(
    fleet: Fleet,
) -> None:
    """R9, R15: row remapping failed (critical): a new host; the old host goes straight to
    revalidation, fails its diagnostics and stays out; the node rejoins healthy."""
    await fleet.add_machines(["gpu-a"], pool="h100", cluster="c1")
    await fleet.set_policy(Policy(mode="Automatic", trusted_actions=[Action.MIGRATE]))
    await fleet.start_remediator()
    fleet.inject("gpu-a", "row-remap-failure", gpu=1)
    await fleet.until(lambda: _has_alerts(fleet, 1))
    fleet.clock.advance(seconds=61)
    done = await fleet.remediation_in("gpu-a", RemediationState.DONE)
    assert done.action is Action.MIGRATE
    assert done.host_before == "host-gpu-a" and done.host_after.startswith("host-gpu-a-")
    old = await fleet.bus.bucket(names.BUCKET_HOSTS, HostRecord).get("host-gpu-a")
    assert old is not None and old.value.state == "Failed"
    assert any("RowRemapFailure" in f for f in old.value.findings)
    assert (fleet.state_dir / "hosts" / "host-gpu-a" / "dcgm.prom").exists()


# -- R12: a power cycle checks the boot id ------------------------------------------------------


async def test_power_cycle_is_not_repeated_on_a_host_that_came_back(fleet: Fleet) -> None:
    """A remediator stopped after it marked the power cycle Running, before it recorded the
    issue; meanwhile the host came back on its own (new boot id). The next one does not cycle
    it again."""
    await fleet.add_machines(["gpu-a"], pool="h100", cluster="c1")
    await fleet.set_policy(Policy(mode="Automatic", trusted_actions=[Action.POWER_CYCLE]))
    first = await fleet.start_remediator("r1")
    gate = _Gate(first)
    fleet.inject("gpu-a", "xid", xid=79)
    await fleet.until(lambda: _has_alerts(fleet, 1))
    fleet.clock.advance(seconds=61)
    running = await fleet.remediation_in("gpu-a", RemediationState.RUNNING)
    assert running.action is Action.POWER_CYCLE and running.issued_time is None
    await fleet.stop_remediator(first)
    assert gate.blocked
    await fleet.agents["gpu-a"].reboot(RebootRequest(op_id="the host came back by itself"))
    await fleet.start_remediator("r1")
    done = await fleet.remediation_in("gpu-a", RemediationState.DONE, RemediationState.FAILED)
    assert "R12" in done.issue_skipped
    assert fleet.executed == []


# -- R8: external detectors ---------------------------------------------------------------------


def external(
    node: str, request_id: str = "req-1", action: Action = Action.REBOOT, **kw: object
) -> RepairRequest:
    evidence = Evidence(
        kind=AlertKind.EXTERNAL,
        source="external:gpu-burn",
        node=node,
        where="gpu-burn --check",
        observed_time=now(),
        severity="critical",
        lines=["GPU 3: FAULTY (errors: 12)"],
    )
    fields: dict[str, object] = {
        "detector": "gpu-burn",
        "request_id": request_id,
        "node": node,
        "action": action,
        "evidence": [evidence],
    }
    fields.update(kw)
    return RepairRequest(**fields)  # type: ignore[arg-type]


async def test_external_requests(fleet: Fleet) -> None:
    await fleet.add_machines(["gpu-a", "gpu-b", "gpu-c", "gpu-d"], pool="h100", cluster="c1")
    await fleet.start_remediator()
    bus = fleet.bus

    async def ask(request: RepairRequest) -> RemediationReply:
        return await bus.request(names.API_REMEDIATION_REQUEST, request, RemediationReply)

    first = await ask(external("gpu-a"))
    assert first.created and first.remediation.requester.kind == "external"
    assert first.remediation.requester.detector == "gpu-burn"
    assert first.remediation.requester.request_id == "req-1"
    assert first.remediation.approver is not None and "R8" in first.remediation.approver.rule
    again = await ask(external("gpu-a"))  # the same (detector, request id): one repair
    assert not again.created and again.remediation.id == first.remediation.id
    for refused, code in [
        (external("gpu-b", "r2", Action.DELETE), ErrorCode.INVALID),
        (external("gpu-b", "r3", evidence=[]), ErrorCode.INVALID),
        (
            external(
                "gpu-b",
                "r4",
                evidence=[
                    Evidence(
                        kind=AlertKind.NODE_NOT_READY,
                        source="external:x",
                        node="gpu-b",
                        where="k8s",
                        observed_time=now(),
                        lines=["NotReady"],
                    )
                ],
            ),
            ErrorCode.INVALID,
        ),
        (
            external(
                "gpu-b", "r5", evidence=[msgspec.structs.replace(external("gpu-c").evidence[0])]
            ),
            ErrorCode.INVALID,
        ),
        (external("gpu-z", "r6"), ErrorCode.NOT_FOUND),
        (external("gpu-a", "r7"), ErrorCode.CONFLICT),  # gpu-a is being repaired
    ]:
        with pytest.raises(NodusError) as caught:
            await ask(refused)
        assert caught.value.code is code, refused
    # skips approval: it runs without anyone approving it
    done = await fleet.remediation_in("gpu-a", RemediationState.DONE)
    assert done.id == first.remediation.id
    assert [(n, a) for n, a, _ in fleet.executed] == [("gpu-a", Action.REBOOT)]
    # R11 for externals: migrate with warning evidence only runs as reprovision
    warned = external("gpu-b", "r8", Action.MIGRATE)
    warned = msgspec.structs.replace(
        warned, evidence=[msgspec.structs.replace(warned.evidence[0], severity="warning")]
    )
    migrated = await ask(warned)
    assert migrated.remediation.action is Action.REPROVISION


async def test_external_cap_and_capacity(fleet: Fleet) -> None:
    await fleet.add_machines([f"gpu-{i}" for i in range(10)], pool="h100", cluster="c1")
    from services.remediator.guardrails import Settings

    await fleet.start_remediator(settings=Settings(external_cap=2, min_available_fraction=0.5))
    leases = fleet.bus.bucket(names.BUCKET_LEASES, Lease)
    for i in range(10):  # busy nodes: the repairs wait, so they stay active
        await leases.put(f"gpu-{i}", Lease(gang=f"o.j{i}", epoch=1, placer="p", created_time=now()))

    async def ask(request: RepairRequest) -> RemediationReply:
        return await fleet.bus.request(names.API_REMEDIATION_REQUEST, request, RemediationReply)

    await ask(external("gpu-0", "a"))
    await ask(external("gpu-1", "b"))
    with pytest.raises(NodusError) as caught:
        await ask(external("gpu-2", "c"))
    assert caught.value.code is ErrorCode.CONFLICT and "cap" in caught.value.message
    # a person cordoned half the cluster: the capacity check refuses more
    cordons = fleet.bus.bucket(names.BUCKET_CORDONS, Cordon)
    for i in range(5, 10):
        await cordons.put(
            f"gpu-{i}",
            Cordon(
                node=f"gpu-{i}", holds={"bob": CordonHold(by="bob", reason="maint", time=now())}
            ),
        )
    await fleet.bus.request(
        names.API_REMEDIATION_CANCEL,
        CancelRequest(id=(await fleet.remediations("gpu-1"))[0].id, by="bob"),
        RemediationReply,
    )

    async def seen() -> bool:
        return all(n in fleet.remediators[0][0].cordons for n in (f"gpu-{i}" for i in range(5, 10)))

    await fleet.until(seen, scan=False)
    with pytest.raises(NodusError) as caught:
        await ask(external("gpu-3", "d"))
    assert caught.value.code is ErrorCode.CONFLICT and "capacity" in caught.value.message


# -- cancel, and cordons of others --------------------------------------------------------------


async def test_cancel_and_a_cordon_placed_by_someone_else_stays(fleet: Fleet) -> None:
    await fleet.add_machines(["gpu-a"], pool="h100", cluster="c1")
    await fleet.set_policy(Policy(mode="Automatic", trusted_actions=[Action.REBOOT]))
    cordons = fleet.bus.bucket(names.BUCKET_CORDONS, Cordon)
    await cordons.put(
        "gpu-a",
        Cordon(node="gpu-a", holds={"bob": CordonHold(by="bob", reason="maintenance", time=now())}),
    )
    await fleet.start_remediator()
    fleet.inject("gpu-a", "readonly-fs")
    await fleet.until(lambda: _has_alerts(fleet, 1))
    fleet.clock.advance(seconds=61)
    await fleet.remediation_in("gpu-a", RemediationState.DONE)

    async def only_bob() -> bool:
        found = await cordons.get("gpu-a")
        return found is not None and set(found.value.holds) == {"bob"}

    await fleet.until(only_bob)
    # a repair waiting for idle can be cancelled; a running one cannot
    leases = fleet.bus.bucket(names.BUCKET_LEASES, Lease)
    await leases.put("gpu-a", Lease(gang="acme.train", epoch=1, placer="p", created_time=now()))
    fleet.inject("gpu-a", "readonly-fs")
    fleet.clock.advance(minutes=40)
    waiting = await fleet.remediation_in("gpu-a", RemediationState.WAITING_IDLE)
    reply = await fleet.bus.request(
        names.API_REMEDIATION_CANCEL,
        CancelRequest(id=waiting.id, by="carol", reason="not now"),
        RemediationReply,
    )
    assert reply.remediation.state is RemediationState.CANCELLED
    assert reply.remediation.history[-1].by == "carol"
    await fleet.until(only_bob)


# -- R13: breaker, budget, pool -----------------------------------------------------------------


async def test_one_repair_at_a_time_per_pool_and_the_cluster_budget(fleet: Fleet) -> None:
    await fleet.add_machines(["a-1", "a-2"], pool="pool-a", cluster="c1")
    await fleet.add_machines(["b-1"], pool="pool-b", cluster="c1")
    from services.remediator.guardrails import Settings

    await fleet.set_policy(Policy(mode="Automatic", trusted_actions=[Action.REBOOT]))
    remediator = await fleet.start_remediator(
        settings=Settings(persistence=timedelta(seconds=60), budget_fraction=0.0, budget_min=1)
    )
    blocker = _Gate(remediator)  # holds every action until released
    for node in ("a-1", "a-2", "b-1"):
        fleet.inject(node, "readonly-fs")
    await fleet.until(lambda: _has_alerts(fleet, 3))
    fleet.clock.advance(seconds=61)

    async def one_running() -> bool:
        rems = await fleet.remediations()
        return len(rems) == 3 and sum(r.state is RemediationState.RUNNING for r in rems) == 1

    await fleet.until(one_running)
    waits = {
        r.node: r.reason
        for r in await fleet.remediations()
        if r.state is RemediationState.WAITING_IDLE
    }
    assert len(waits) == 2
    assert any("budget" in reason for reason in waits.values()) or any(
        "pool" in reason for reason in waits.values()
    )
    blocker.release()

    async def all_done() -> bool:
        return all(r.state is RemediationState.DONE for r in await fleet.remediations())

    await fleet.until(all_done, timeout=20)


async def test_the_breaker_opens_on_a_surge_and_is_reset_by_a_person(fleet: Fleet) -> None:
    nodes = [f"gpu-{i}" for i in range(8)]
    await fleet.add_machines(nodes, pool="h100", cluster="c1")
    from services.remediator.guardrails import Settings

    await fleet.set_policy(Policy(mode="Automatic", trusted_actions=[Action.REBOOT]))
    leases = fleet.bus.bucket(names.BUCKET_LEASES, Lease)
    for node in nodes:  # busy: nothing starts, so the surge is visible
        await leases.put(node, Lease(gang=f"o.{node}", epoch=1, placer="p", created_time=now()))
    await fleet.start_remediator(
        settings=Settings(persistence=timedelta(seconds=60), breaker_surge=3, breaker_fraction=0.0)
    )
    for node in nodes:
        fleet.inject(node, "readonly-fs")
    await fleet.until(lambda: _has_alerts(fleet, 8))
    fleet.clock.advance(seconds=61)

    async def all_created() -> bool:
        return len(await fleet.remediations()) == 8

    await fleet.until(all_created)
    breaker = await fleet.bus.bucket(names.BUCKET_BREAKERS, Breaker).get("c1")
    assert breaker is not None and breaker.value.open and breaker.value.trips == 1
    rems = await fleet.remediations()

    async def held() -> bool:
        rems[:] = await fleet.remediations()
        return all(r.state is RemediationState.PENDING for r in rems)

    await fleet.until(held)  # the three admitted before the trip went back to a person too
    assert all(r.approver is None for r in rems)
    assert len(await fleet.alerts()) == 8  # no alert lost
    reply = await fleet.bus.request(
        names.API_REMEDIATION_BREAKER_RESET,
        BreakerResetRequest(cluster="c1", by="alice"),
        BreakerReply,
    )
    assert not reply.breaker.open and reply.breaker.reset_by == "alice"
    fleet.clock.advance(hours=3)
    await fleet.scan()
    await fleet.scan()
    # nothing held back is replayed when it closes
    assert all(r.state is RemediationState.PENDING for r in await fleet.remediations())
    assert fleet.executed == []


# -- helpers ------------------------------------------------------------------------------------


def _count(counter: Any) -> float:
    return float(counter._value.get())


def faults_clear(fleet: Fleet, node: str, kind: str) -> None:
    from services.remediator import faults

    faults.clear(fleet.machine_dir(node), kind)


async def _has_alerts(fleet: Fleet, count: int) -> bool:
    return len(await fleet.alerts()) >= count


async def _firing(fleet: Fleet, count: int) -> bool:
    alerts = await fleet.alerts()
    return sum(a.state is AlertState.FIRING for a in alerts.values()) >= count


class _Gate:
    """Blocks a remediator's provider from carrying out actions until released."""

    def __init__(self, remediator: object) -> None:
        import asyncio

        self.event = asyncio.Event()
        self.blocked = False
        provider = remediator.provider  # type: ignore[attr-defined]
        inner = provider.execute

        async def execute(node: str, action: Action, op_id: str) -> None:
            self.blocked = True
            await self.event.wait()
            await inner(node, action, op_id)

        provider.execute = execute

    def release(self) -> None:
        self.event.set()


async def test_delete_is_the_top_rung_and_always_a_persons_decision(fleet: Fleet) -> None:
    """R9, R10, R15: a fault that two migrations did not fix climbs to Delete; even a fully
    automatic policy waits for a person; the machine is retired, stays cordoned, and its host
    goes to revalidation."""
    from datetime import timedelta as td

    from libs.contracts.remediation import LadderAttempt
    from services.remediator.ladder import ladder_key

    await fleet.add_machines(["gpu-a"], pool="h100", cluster="c1")
    await fleet.set_policy(Policy(mode="Automatic", trusted_actions=list(Action)))
    key = ladder_key("gpu-a", "c1", AlertKind.ROW_REMAP_FAILURE, None)
    earlier = [
        LadderAttempt(
            remediation_id=f"old-{i}", action=Action.MIGRATE, time=now() - td(days=i + 1),
            outcome=Outcome.DONE,
        )
        for i in range(2)
    ]  # fmt: skip
    await fleet.bus.bucket(names.BUCKET_LADDERS, Ladder).put(
        key,
        Ladder(
            key=key, node="gpu-a", cluster="c1", kind=AlertKind.ROW_REMAP_FAILURE, attempts=earlier
        ),
    )
    await fleet.start_remediator()
    fleet.inject("gpu-a", "row-remap-failure", gpu=0)
    await fleet.until(lambda: _has_alerts(fleet, 1))
    fleet.clock.advance(seconds=61)
    pending = await fleet.remediation_in("gpu-a", RemediationState.PENDING)
    assert pending.action is Action.DELETE and "R9" in pending.reason
    assert "one rung up to Delete" in pending.rule
    await approve(fleet.bus, pending.id, "carol")
    done = await fleet.remediation_in("gpu-a", RemediationState.DONE)
    assert done.approver is not None and done.approver.name == "carol"
    state = await fleet.bus.bucket(names.BUCKET_MACHINES, MachineState).get("gpu-a")
    assert state is not None and state.value.retired
    host = await fleet.bus.bucket(names.BUCKET_HOSTS, HostRecord).get("host-gpu-a")
    assert host is not None and host.value.state == "Failed"
    cordon = await fleet.bus.bucket(names.BUCKET_CORDONS, Cordon).get("gpu-a")
    assert cordon is not None and "retired" in cordon.value.holds


async def test_repairing_a_member_restarts_its_gang_in_a_new_epoch(
    fleet: Fleet, start_placer: StartPlacer
) -> None:
    """R16 with the real placer: the repair interrupts a placed gang (max wait 0); the gang
    goes back to placement without the node, the placer fences the old epoch first, and the
    next epoch runs on other machines."""
    from libs.client.client import Client
    from libs.contracts.epochs import Epoch
    from libs.contracts.jobs import Job, Phase
    from tests.factories import job

    for i, name in enumerate(["gpu-a", "gpu-b", "gpu-c"]):
        await fleet.add_machines([name], pool=f"p{i}", cluster="c1", address=f"10.0.0.{i + 1}")
    await fleet.set_policy(
        Policy(mode="Automatic", trusted_actions=[Action.REBOOT], idle=IdleWait(max_wait_seconds=0))
    )
    await start_placer()
    wanted = job("train", "acme", distributed={"members": 2})
    await Client(fleet.bus).apply(wanted)
    jobs = fleet.bus.bucket(names.BUCKET_JOBS, Job)

    async def placed(epoch: int) -> Job | None:
        current = await jobs.get(wanted.key)
        if (
            current
            and current.value.status.phase is Phase.PLACED
            and current.value.status.epoch == epoch
        ):
            return current.value
        return None

    async def first() -> bool:
        return await placed(1) is not None

    await fleet.until(first, scan=False)
    first_job = await placed(1)
    assert first_job is not None and first_job.status.gang is not None
    members = [m.node for m in first_job.status.gang.members]
    spare = ({"gpu-a", "gpu-b", "gpu-c"} - set(members)).pop()
    await fleet.start_remediator()
    fleet.inject(members[0], "readonly-fs")

    async def alerted() -> bool:
        return bool(await fleet.alerts())

    await fleet.until(alerted)
    fleet.clock.advance(seconds=61)
    done = await fleet.remediation_in(members[0], RemediationState.DONE, timeout=15)
    assert done.interrupted == [wanted.key]

    async def second() -> bool:
        return await placed(2) is not None

    await fleet.until(second, scan=False, timeout=20)
    second_job = await placed(2)
    assert second_job is not None and second_job.status.gang is not None
    assert members[0] in second_job.status.avoid
    assert {m.node for m in second_job.status.gang.members} == {members[1], spare}
    old = await fleet.bus.bucket(names.BUCKET_EPOCHS, Epoch).get(names.epoch_key(wanted.key, 1))
    assert old is not None and old.value.fenced  # fenced before the member was replaced

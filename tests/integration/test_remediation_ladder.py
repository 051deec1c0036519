"""The escalation ladder on a real nats-server (R9-R12): a fault that keeps coming back
climbs a rung, Migrate needs critical evidence, a power cycle checks the boot id, and Delete
is the top rung and always a person's decision."""

from __future__ import annotations

from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.remediation import (
    Action,
    AlertKind,
    Cordon,
    HostRecord,
    Ladder,
    MachineState,
    Outcome,
    Policy,
    RebootRequest,
    RemediationState,
)
from tests.integration.remediation_fixtures import (
    Gate,
    approve,
    firing,
    fleet_fixture,  # noqa: F401  (the `fleet` fixture)
    has_alerts,
)
from tests.remediation_support import Fleet

# -- R10: the ladder; R11 migrate without critical evidence -------------------------------------


async def test_a_fault_that_keeps_coming_back_climbs_the_ladder(fleet: Fleet) -> None:
    await fleet.add_machines(["gpu-a"], pool="h100", cluster="c1")
    await fleet.set_policy(
        Policy(mode="Automatic", trusted_actions=[Action.REBOOT, Action.REPROVISION])
    )
    await fleet.start_remediator()
    fleet.inject("gpu-a", "xid", xid=48, sticky=True)  # hardware: comes back after a reboot
    await fleet.until(lambda: firing(fleet, 1))
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
    await fleet.until(lambda: has_alerts(fleet, 1))
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
    await fleet.until(lambda: has_alerts(fleet, 1))
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
    gate = Gate(first)
    fleet.inject("gpu-a", "xid", xid=79)
    await fleet.until(lambda: has_alerts(fleet, 1))
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
    await fleet.until(lambda: has_alerts(fleet, 1))
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

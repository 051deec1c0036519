"""A repair's life on a real nats-server (R5-R7, R9, R13 cordon, R15, R16): approval,
the idle wait, the repair through the local machine provider and in-process agents,
revalidation, the audit trail of every step, and the gang it interrupts."""

from __future__ import annotations

from datetime import timedelta

from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.epochs import Lease
from libs.contracts.remediation import (
    Action,
    AlertState,
    Cordon,
    IdleWait,
    Outcome,
    Policy,
    RemediationState,
    XidConsent,
)
from tests.conftest import StartPlacer
from tests.integration.remediation_fixtures import (
    approve,
    fleet_fixture,  # noqa: F401  (the `fleet` fixture)
    has_alerts,
)
from tests.remediation_support import Fleet

# -- R5, R6, R7, R9 (reboot), R13 (cordon), R15 (revalidation) --------------------------------


async def test_approved_reboot_waits_for_idle_repairs_revalidates_and_rejoins(
    fleet: Fleet,
) -> None:
    await fleet.add_machines(["gpu-a", "gpu-b"], pool="h100", cluster="c1")
    await fleet.start_remediator()
    boot_before = fleet.agents["gpu-a"].boot_id
    # A fault that leaves the workload running waits for idle (R6; R17's do not).
    fleet.inject("gpu-a", "row-remap-pending")
    await fleet.until(lambda: has_alerts(fleet, 1))
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
    assert done.rule.startswith("RowRemapPending -> Reboot")
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
    fleet.inject("gpu-a", "row-remap-pending")  # leaves the workload running (not R17)
    await fleet.until(lambda: has_alerts(fleet, 1))
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
    fleet.inject("gpu-a", "row-remap-pending")
    await fleet.until(lambda: has_alerts(fleet, 1))
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
    await fleet.until(lambda: has_alerts(fleet, 2))
    fleet.clock.advance(seconds=61)
    auto = await fleet.remediation_in("gpu-a", RemediationState.DONE)
    assert auto.approver is not None and auto.approver.kind == "policy"
    assert "Xid 119" in auto.approver.rule
    person = await fleet.remediation_in("gpu-b", RemediationState.PENDING)
    assert person.approver is None


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
    fleet.inject(members[0], "row-remap-pending")  # the workload keeps running (not R17)

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

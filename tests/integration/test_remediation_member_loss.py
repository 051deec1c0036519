"""R17 on a real nats-server with the real placer: a fault that takes away what a member's
ranks run on ends the gang's epoch at once (before the persistence window, before any
approval), the gang is placed again without the machine, and the repair then finds the machine
idle. Faults that leave the workload running restart nothing."""

from __future__ import annotations

from libs.client.client import Client
from libs.contracts import names
from libs.contracts.epochs import Epoch, Lease
from libs.contracts.jobs import ConditionType, Job, Phase
from libs.contracts.remediation import Action, IdleWait, Policy, RemediationState
from tests.conftest import StartPlacer
from tests.factories import job
from tests.integration.remediation_fixtures import (
    fleet_fixture,  # noqa: F401  (the `fleet` fixture)
    has_alerts,
)
from tests.remediation_support import Fleet


async def _placed_gang(fleet: Fleet, start_placer: StartPlacer) -> tuple[str, list[str], str]:
    for i, name in enumerate(["gpu-a", "gpu-b", "gpu-c"]):
        await fleet.add_machines([name], pool=f"p{i}", cluster="c1", address=f"10.0.0.{i + 1}")
    await start_placer()
    wanted = job("train", "acme", distributed={"members": 2})
    await Client(fleet.bus).apply(wanted)
    jobs = fleet.bus.bucket(names.BUCKET_JOBS, Job)

    async def placed() -> bool:
        current = await jobs.get(wanted.key)
        return current is not None and current.value.status.phase is Phase.PLACED

    await fleet.until(placed, scan=False)
    current = await jobs.get(wanted.key)
    assert current is not None and current.value.status.gang is not None
    members = [m.node for m in current.value.status.gang.members]
    spare = ({"gpu-a", "gpu-b", "gpu-c"} - set(members)).pop()
    return wanted.key, members, spare


async def test_a_gpu_off_the_bus_ends_the_epoch_at_once_and_the_repair_finds_it_idle(
    fleet: Fleet, start_placer: StartPlacer
) -> None:
    await fleet.set_policy(
        Policy(
            mode="Automatic",
            trusted_actions=[Action.REBOOT, Action.POWER_CYCLE],
            idle=IdleWait(never_interrupt=True),  # R17's faults do not wait for idle
        )
    )
    gang, members, spare = await _placed_gang(fleet, start_placer)
    await fleet.start_remediator()
    fleet.inject(members[0], "xid", xid=79)
    jobs = fleet.bus.bucket(names.BUCKET_JOBS, Job)

    async def second_epoch() -> bool:
        current = await jobs.get(gang)
        return current is not None and current.value.status.epoch == 2

    # No clock advance: the epoch ends on the alert, not after the persistence window.
    await fleet.until(second_epoch, scan=True, timeout=20)
    current = await jobs.get(gang)
    assert current is not None and current.value.status.gang is not None
    assert members[0] in current.value.status.avoid
    assert {m.node for m in current.value.status.gang.members} == {members[1], spare}
    old = await fleet.bus.bucket(names.BUCKET_EPOCHS, Epoch).get(names.epoch_key(gang, 1))
    assert old is not None and old.value.fenced
    events = [e for e in await Client(fleet.bus).events(current.value)]
    broke = [e for e in events if e.kind == "FaultBrokeMember"]
    assert broke and "R17" in broke[0].message and "Xid 79" in broke[0].message
    # The repair: after the window, approved by policy, on a machine already idle.
    fleet.clock.advance(seconds=61)
    done = await fleet.remediation_in(members[0], RemediationState.DONE, timeout=20)
    assert done.action is Action.POWER_CYCLE and done.breaks_workload
    # "never interrupt" was the policy, and the repair ran anyway: the node was idle already.
    assert done.never_interrupt and done.interrupted == [] and "R17" in done.rule


async def test_faults_that_leave_the_workload_running_restart_nothing(
    fleet: Fleet, start_placer: StartPlacer
) -> None:
    await fleet.set_policy(
        Policy(
            mode="Automatic",
            trusted_actions=[Action.REBOOT, Action.REPROVISION, Action.MIGRATE],
            idle=IdleWait(never_interrupt=True),
        )
    )
    gang, members, _ = await _placed_gang(fleet, start_placer)
    await fleet.start_remediator()
    fleet.inject(members[0], "xid", xid=13)  # an application error
    fleet.inject(members[1], "thermal")
    await fleet.until(lambda: has_alerts(fleet, 2))
    fleet.clock.advance(seconds=61)
    waiting = await fleet.remediation_in(members[1], RemediationState.WAITING_IDLE, timeout=15)
    assert waiting.never_interrupt and not waiting.breaks_workload
    await fleet.scan()
    current = await fleet.bus.bucket(names.BUCKET_JOBS, Job).get(gang)
    assert current is not None and current.value.status.epoch == 1
    assert current.value.status.phase is Phase.PLACED
    ready = current.value.condition(ConditionType.GANG_READY)
    assert ready is None or ready.reason not in ("FaultBrokeMember", "NodeRepair")
    lease = await fleet.bus.bucket(names.BUCKET_LEASES, Lease).get(members[1])
    assert lease is not None and lease.value.gang == gang

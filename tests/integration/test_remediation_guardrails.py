"""Guardrails on a real nats-server (R13): a recommendation disappears with its alert,
the cooldown after a repair, one repair at a time per pool, the cluster budget, and the
circuit breaker."""

from __future__ import annotations

from datetime import timedelta

from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.epochs import Lease
from libs.contracts.remediation import (
    Action,
    Breaker,
    BreakerReply,
    BreakerResetRequest,
    Outcome,
    Policy,
    RemediationState,
)
from tests.integration.remediation_fixtures import (
    Gate,
    faults_clear,
    fleet_fixture,  # noqa: F401  (the `fleet` fixture)
    has_alerts,
)
from tests.remediation_support import Fleet

# -- R13: the recommendation disappears with its alert; cooldown --------------------------------


async def test_recommendation_disappears_when_the_alert_clears(fleet: Fleet) -> None:
    await fleet.add_machines(["gpu-a"], pool="h100", cluster="c1")
    await fleet.start_remediator()
    fleet.inject("gpu-a", "readonly-fs")
    await fleet.until(lambda: has_alerts(fleet, 1))
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
    await fleet.until(lambda: has_alerts(fleet, 1))
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


# -- R13: breaker, budget, pool -----------------------------------------------------------------


async def test_one_repair_at_a_time_per_pool_and_the_cluster_budget(fleet: Fleet) -> None:
    await fleet.add_machines(["a-1", "a-2"], pool="pool-a", cluster="c1")
    await fleet.add_machines(["b-1"], pool="pool-b", cluster="c1")
    from services.remediator.guardrails import Settings

    await fleet.set_policy(Policy(mode="Automatic", trusted_actions=[Action.REBOOT]))
    remediator = await fleet.start_remediator(
        settings=Settings(persistence=timedelta(seconds=60), budget_fraction=0.0, budget_min=1)
    )
    blocker = Gate(remediator)  # holds every action until released
    for node in ("a-1", "a-2", "b-1"):
        fleet.inject(node, "readonly-fs")
    await fleet.until(lambda: has_alerts(fleet, 3))
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
    for node in nodes:  # faults that leave the workload running: they wait for idle (not R17)
        fleet.inject(node, "row-remap-pending")
    await fleet.until(lambda: has_alerts(fleet, 8))
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

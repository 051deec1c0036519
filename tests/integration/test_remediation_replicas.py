"""R14 on a real nats-server: two remediator replicas race on every fault, one of them is
stopped in the middle of a repair and started again, and every fault gets exactly one repair;
nothing finished is repeated and a stale signal changes nothing."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest

from libs.bus import Bus
from libs.contracts import names
from libs.contracts.fleet import NodeHealth
from libs.contracts.remediation import (
    Action,
    AlertState,
    Policy,
    RemediationState,
    SignalReport,
)
from libs.runtime.tasks import cancel_and_wait
from tests.integration.remediation_fixtures import fleet_fixture  # noqa: F401  (the `fleet` fixture)
from tests.remediation_support import TEST_SETTINGS, Fleet

FAULTS: dict[str, tuple[str, dict[str, Any]]] = {
    "gpu-a": ("readonly-fs", {}),
    "gpu-b": ("xid", {"xid": 48}),
    "gpu-c": ("ecc-dbe", {"gpu": 1}),
    "gpu-d": ("ib-down", {"port": "mlx5_0/1"}),
}


class BootIds:
    """Every boot id each node reported: one more than the times it rebooted."""

    def __init__(self, bus: Bus) -> None:
        self.seen: dict[str, set[str]] = {}
        self.task = asyncio.create_task(self._watch(bus))

    async def _watch(self, bus: Bus) -> None:
        async for change in bus.bucket(names.BUCKET_HEALTH, NodeHealth).watch(history=True):
            if change.value is not None and change.value.boot_id:
                self.seen.setdefault(change.key, set()).add(change.value.boot_id)

    def reboots(self) -> dict[str, int]:
        return {node: len(ids) - 1 for node, ids in self.seen.items() if len(ids) > 1}

    async def stop(self) -> None:
        await cancel_and_wait([self.task])


@pytest.mark.slow
async def test_two_replicas_and_a_restart_mid_repair_make_one_repair_per_fault(
    fleet: Fleet,
) -> None:
    await fleet.add_machines([*FAULTS, "gpu-e", "gpu-f"], pool="h100", cluster="c1")
    # separate pools would let repairs run side by side; one pool serialises them, which
    # keeps one repair in flight when the replica stops
    await fleet.set_policy(Policy(mode="Automatic", trusted_actions=[Action.REBOOT]))
    boots = BootIds(fleet.bus)
    settings = TEST_SETTINGS
    r1 = await fleet.start_remediator("r1", settings)
    # r1 takes its first action and stops in the middle of it
    gate_hit: list[str] = []
    inner = r1.provider.execute

    async def stuck(node: str, action: Action, op_id: str) -> None:
        gate_hit.append(node)
        await asyncio.Event().wait()
        await inner(node, action, op_id)

    r1.provider.execute = stuck  # type: ignore[method-assign]
    for node, (kind, options) in FAULTS.items():
        fleet.inject(node, kind, **options)

    async def all_alerts() -> bool:
        return len(await fleet.alerts()) >= len(FAULTS)

    await fleet.until(all_alerts)
    fleet.clock.advance(seconds=61)

    async def r1_in_flight() -> bool:
        return bool(gate_hit)

    await fleet.until(r1_in_flight, timeout=20)
    await fleet.start_remediator("r2", settings)  # from now on both race on everything
    stuck_node = gate_hit[0]
    running = [r for r in await fleet.remediations(stuck_node) if r.active]
    assert running and running[0].state is RemediationState.RUNNING
    assert running[0].executor == "r1" and running[0].issued_time is None
    await fleet.stop_remediator(r1)
    # r2 does not take over a fresh claim: the repair waits for r1 to come back
    for _ in range(3):
        await fleet.scan()
    assert fleet.executed == []
    await fleet.start_remediator("r1", settings)  # restarted: resumes its own claim

    async def all_done() -> bool:
        rems = await fleet.remediations()
        return len(rems) >= len(FAULTS) and all(r.state is RemediationState.DONE for r in rems)

    await fleet.until(all_done, timeout=30)
    rems = await fleet.remediations()
    assert sorted(r.node for r in rems) == sorted(FAULTS)  # one repair per fault
    assert sorted(node for node, _, _ in fleet.executed) == sorted(FAULTS)
    assert boots.reboots() == dict.fromkeys(FAULTS, 1)  # each machine rebooted once
    assert {r.executor for r in rems} <= {"r1", "r2"}

    # the faults cleared with the reboots; restart both replicas: nothing is repeated
    async def resolved() -> bool:
        return all(a.state is AlertState.RESOLVED for a in (await fleet.alerts()).values())

    await fleet.until(resolved)
    for remediator, _ in list(fleet.remediators):
        await fleet.stop_remediator(remediator)
    await fleet.start_remediator("r1", settings)
    await fleet.start_remediator("r2", settings)
    # a stale report (older than what resolved the alert) arrives late: ignored
    stale_node = "gpu-a"
    alerts = await fleet.alerts()
    [alert] = [a for a in alerts.values() if a.node == stale_node]
    stale = SignalReport(
        node=stale_node,
        source=alert.source,
        observed_time=alert.last_seen_time - timedelta(seconds=1),
        findings=[],
    )
    signals = fleet.bus.bucket(names.BUCKET_SIGNALS, SignalReport)
    await signals.put(names.signal_key(stale_node, alert.source), stale)
    fleet.clock.advance(hours=1)
    for _ in range(5):
        await fleet.scan()
    assert len(await fleet.remediations()) == len(FAULTS)
    assert len(fleet.executed) == len(FAULTS)
    assert boots.reboots() == dict.fromkeys(FAULTS, 1)
    await boots.stop()


@pytest.mark.slow
async def test_a_claim_left_by_a_replica_that_never_returns_is_taken_over(fleet: Fleet) -> None:
    await fleet.add_machines(["gpu-a"], pool="h100", cluster="c1")
    await fleet.set_policy(Policy(mode="Automatic", trusted_actions=[Action.REBOOT]))
    r1 = await fleet.start_remediator("r1")
    gate_hit: list[str] = []

    async def stuck(node: str, action: Action, op_id: str) -> None:
        gate_hit.append(node)
        await asyncio.Event().wait()

    r1.provider.execute = stuck  # type: ignore[method-assign]
    fleet.inject("gpu-a", "readonly-fs")

    async def alerted() -> bool:
        return bool(await fleet.alerts())

    await fleet.until(alerted)
    fleet.clock.advance(seconds=61)

    async def in_flight() -> bool:
        return bool(gate_hit)

    await fleet.until(in_flight)
    await fleet.stop_remediator(r1)
    await fleet.start_remediator("r2")
    await fleet.scan()
    assert fleet.executed == []  # r1's claim is fresh: r2 waits
    fleet.clock.advance(seconds=31)  # the claim grace passes: r2 takes it over
    done = await fleet.remediation_in("gpu-a", RemediationState.DONE)
    assert done.executor == "r2"
    assert [n for n, _, _ in fleet.executed] == ["gpu-a"]

"""R13 under an alert storm: 500 nodes of a generated fleet report a fault at once (a storage
event, say). The breaker opens after the configured surge of automatic repairs, no further
automatic repair starts, and every alert is kept."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from libs.bus import Bus
from libs.bus.server import NatsServer
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.fleet import NodeHealth
from libs.contracts.remediation import (
    Action,
    Alert,
    AlertState,
    Breaker,
    Policy,
    Remediation,
    RemediationState,
    SignalReport,
)
from services.remediator.guardrails import Settings
from services.remediator.main import BUCKETS
from services.remediator.service import Remediator
from tests.conftest import eventually
from tests.factories import machine, node_record, register
from tests.remediation_support import readonly_report

NODES = 500
SURGE = 10


class FakeProvider:
    """Machines without agents: a reboot is a new boot id in `nodus-health`."""

    def __init__(self, bus: Bus) -> None:
        self.health = bus.bucket(names.BUCKET_HEALTH, NodeHealth)
        self.done: dict[str, str] = {}
        self.started: list[str] = []

    async def execute(self, node: str, action: Action, op_id: str) -> None:
        if self.done.get(node) == op_id:
            return
        self.started.append(node)
        await self.health.put(
            node, NodeHealth(node=node, healthy=True, heartbeat_time=now(), boot_id=op_id)
        )
        self.done[node] = op_id

    async def executed(self, node: str, op_id: str) -> bool:
        return self.done.get(node) == op_id

    async def host(self, node: str) -> tuple[str, bool]:
        return f"host-{node}", False

    async def diagnose(self, node: str) -> list[str]:
        return []

    async def has_capacity(self, node: str, action: Action) -> bool:
        return True


@pytest.mark.slow
async def test_an_alert_storm_opens_the_breaker_and_loses_no_alert(
    bus: Bus, nats_server: NatsServer
) -> None:
    nodes = [f"n{i:03d}" for i in range(NODES)]
    records = [
        node_record(machine(n, pool=f"pool-{i // 5}", cluster="big")) for i, n in enumerate(nodes)
    ]
    await register(bus, records)
    for name in names.REMEDIATION_BUCKETS:
        await bus.ensure_bucket(name)
    await bus.bucket(names.BUCKET_REMEDIATION_POLICY, Policy).put(
        "default", Policy(mode="Automatic", trusted_actions=[Action.REBOOT])
    )
    remediator_bus = await Bus.open(nats_server.url, name="storm", buckets=BUCKETS, streams=True)
    provider = FakeProvider(remediator_bus)
    remediator = Remediator(
        remediator_bus,
        provider,
        Settings(
            persistence=timedelta(0),
            breaker_surge=SURGE,
            breaker_fraction=0.0,
            budget_fraction=0.05,
        ),
        replica="storm",
        tick_seconds=0.5,
    )
    await remediator.start()
    try:
        signals = bus.bucket(names.BUCKET_SIGNALS, SignalReport)
        await asyncio.gather(
            *(signals.put(names.signal_key(n, "npd"), readonly_report(n)) for n in nodes)
        )
        alerts = bus.bucket(names.BUCKET_ALERTS, Alert)

        async def every_alert() -> bool:
            return len(await alerts.snapshot()) == NODES

        await eventually(every_alert, timeout=60)

        rems = bus.bucket(names.BUCKET_REMEDIATIONS, Remediation)

        async def one_remediation_per_node() -> bool:
            return len(await rems.snapshot()) == NODES

        await eventually(one_remediation_per_node, timeout=60)
        await remediator.settled(timeout=30)
        await asyncio.sleep(1.0)  # a few more ticks: nothing else may start
        breaker = await bus.bucket(names.BUCKET_BREAKERS, Breaker).get("big")
        assert breaker is not None and breaker.value.open and breaker.value.trips == 1
        admitted = {e.remediation_id for e in breaker.value.recent}
        assert len(admitted) == SURGE
        everything = [r.value for r in (await rems.snapshot()).values()]
        started = [r for r in everything if r.started_time is not None]
        # only repairs admitted before the surge ever started; none started after it opened
        assert len(started) <= SURGE and {r.id for r in started} <= admitted
        assert sorted(provider.started) == sorted({r.node for r in started})
        opened = breaker.value.opened_time
        assert opened is not None
        assert all(
            r.started_time is not None and r.started_time <= opened + timedelta(seconds=5)
            for r in started
        )
        waiting = [r for r in everything if r.state is RemediationState.PENDING]
        assert len(waiting) >= NODES - SURGE
        assert all("breaker" in r.reason for r in waiting)
        # no alert lost: all 500 kept, with their evidence
        kept = [a.value for a in (await alerts.snapshot()).values()]
        assert len(kept) == NODES and all(a.evidence for a in kept)
        assert sum(a.state is AlertState.FIRING for a in kept) >= NODES - SURGE
    finally:
        await remediator.stop()
        await remediator_bus.close()

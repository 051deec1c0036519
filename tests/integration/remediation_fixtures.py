"""What the remediation integration tests share: the `fleet` fixture (a real nats-server with
the remediation buckets, machines, a monitor and remediators started on demand) and small
helpers. A test module imports `fleet_fixture` to have the `fleet` fixture."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from libs.bus import Bus
from libs.bus.server import NatsServer
from libs.contracts import names
from libs.contracts.remediation import Action, AlertState, ApproveRequest, RemediationReply
from tests.remediation_support import Fleet


@pytest.fixture(name="fleet")
async def fleet_fixture(nats_server: NatsServer, bus: Bus, tmp_path: Path) -> AsyncIterator[Fleet]:
    for name in names.REMEDIATION_BUCKETS:
        await bus.ensure_bucket(name)
    started = Fleet(nats_server.url, bus, tmp_path / "state")
    yield started
    await started.stop()


async def approve(bus: Bus, ident: str, who: str = "alice") -> RemediationReply:
    return await bus.request(
        names.API_REMEDIATION_APPROVE, ApproveRequest(id=ident, approver=who), RemediationReply
    )


def faults_clear(fleet: Fleet, node: str, kind: str) -> None:
    from app.lab import faults

    faults.clear(fleet.machine_dir(node), kind)


async def has_alerts(fleet: Fleet, count: int) -> bool:
    return len(await fleet.alerts()) >= count


async def firing(fleet: Fleet, count: int) -> bool:
    alerts = await fleet.alerts()
    return sum(a.state is AlertState.FIRING for a in alerts.values()) >= count


class Gate:
    """Blocks a remediator's provider from carrying out actions until released."""

    def __init__(self, remediator: object) -> None:
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

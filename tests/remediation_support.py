"""A fleet for the remediator's integration tests: in-process agents on a real nats-server,
each machine's detector inputs in a temporary STATE_DIR, a monitor to scan them, remediator
replicas on their own connections, and a clock the test can move forward."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

from app.lab import faults
from app.lab.provider import LocalProvider
from libs.bus import Bus
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.remediation import (
    Action,
    Alert,
    AlertKind,
    Evidence,
    Finding,
    Policy,
    Recommendation,
    Remediation,
    RemediationState,
    SignalReport,
)
from services.agent.agent import Agent
from services.monitor.detectors.machine import MachinePaths
from services.monitor.monitor import Monitor
from services.monitor.ondemand import Diagnostics
from services.remediator.guardrails import Settings
from services.remediator.main import BUCKETS
from services.remediator.provider import MachineProvider
from services.remediator.service import Remediator
from tests.factories import machine


class Clock:
    """Real time plus an offset the test moves forward (persistence, cooldown, idle wait)."""

    def __init__(self) -> None:
        self.offset = timedelta(0)

    def __call__(self) -> datetime:
        return now() + self.offset

    def advance(self, **delta: float) -> None:
        self.offset += timedelta(**delta)


class CountingProvider:
    """A machine provider (the local one by default), counting the actions it carried out."""

    def __init__(self, inner: MachineProvider, log: list[tuple[str, Action, str]]) -> None:
        self.inner = inner
        self.log = log

    async def execute(self, node: str, action: Action, op_id: str) -> str | None:
        if not await self.inner.executed(node, op_id):
            self.log.append((node, action, op_id))
        return await self.inner.execute(node, action, op_id)

    async def executed(self, node: str, op_id: str) -> bool:
        return await self.inner.executed(node, op_id)

    async def host(self, node: str) -> tuple[str, bool]:
        return await self.inner.host(node)

    async def diagnose(self, node: str) -> list[str]:
        return await self.inner.diagnose(node)

    async def has_capacity(self, node: str, action: Action) -> bool:
        return await self.inner.has_capacity(node, action)


TEST_SETTINGS = Settings(
    persistence=timedelta(seconds=60),
    cooldown=timedelta(minutes=30),
    breaker_surge=5,
    breaker_fraction=0.0,
    claim_grace=timedelta(seconds=30),
)


@dataclass
class Fleet:
    url: str
    bus: Bus
    state_dir: Path
    clock: Clock = field(default_factory=Clock)
    agents: dict[str, Agent] = field(default_factory=dict)
    remediators: list[tuple[Remediator, Bus]] = field(default_factory=list)
    executed: list[tuple[str, Action, str]] = field(default_factory=list)
    monitor: Monitor | None = None

    def machine_dir(self, node: str) -> Path:
        return self.state_dir / "machines" / node

    async def add_machines(
        self, names_: list[str], agent_options: dict[str, Any] | None = None, **fields: Any
    ) -> None:
        for name in names_:
            faults.ensure_baseline(self.machine_dir(name), gpus=2, ib_ports=1)
            agent = Agent(
                self.bus, machine(name, **fields), heartbeat_seconds=0.2, **(agent_options or {})
            )
            await agent.start()
            self.agents[name] = agent
        if self.monitor is not None:
            await self.monitor.stop()
        self.monitor = Monitor(
            self.bus,
            {n: MachinePaths.under(self.machine_dir(n)) for n in self.agents},
            reachability=True,
            probe_timeout=0.5,
            unreachable_seconds=1.0,
            blackholes={n: self.machine_dir(n) / faults.BLACKHOLE for n in self.agents},
        )
        await self.monitor.follow_health()

    async def start_remediator(
        self,
        replica: str = "r1",
        settings: Settings | None = None,
        provider: Callable[[Bus, str], MachineProvider] | None = None,
    ) -> Remediator:
        """A replica on its own connection; `provider(bus, replica)` builds its machine
        provider (default: the local one)."""
        bus = await Bus.open(self.url, name=replica, buckets=BUCKETS, streams=True)
        inner = (
            provider(bus, replica)
            if provider is not None
            else LocalProvider(bus, self.state_dir, self.clock)
        )
        provider_ = CountingProvider(inner, self.executed)
        remediator = Remediator(
            bus,
            provider_,
            settings or TEST_SETTINGS,
            replica=replica,
            clock=self.clock,
            tick_seconds=0.05,
        )
        await remediator.start()
        self.remediators.append((remediator, bus))
        return remediator

    async def stop_remediator(self, remediator: Remediator) -> None:
        for index, (started, bus) in enumerate(self.remediators):
            if started is remediator:
                await started.stop()
                await bus.close()
                del self.remediators[index]
                return

    async def stop(self) -> None:
        for remediator, bus in self.remediators:
            await remediator.stop()
            await bus.close()
        self.remediators.clear()
        for agent in self.agents.values():
            await agent.stop()
        if self.monitor is not None:
            await self.monitor.stop()

    async def serve_diagnostics(self) -> None:
        """Answer `diagnose` for every machine, as each machine's monitor does (R18)."""
        machines = {n: MachinePaths.under(self.machine_dir(n)) for n in self.agents}
        await self.bus.serve(
            "nodus-monitor", "0.0.0", "test monitor", list(Diagnostics(machines).endpoints())
        )

    def inject(self, node: str, kind: str, sticky: bool = False, **options: Any) -> str:
        return faults.inject(self.machine_dir(node), faults.Fault(kind=kind, **options), sticky)

    async def scan(self) -> None:
        assert self.monitor is not None
        await self.monitor.scan()

    async def set_policy(self, policy: Policy, key: str = "default") -> None:
        await self.bus.bucket(names.BUCKET_REMEDIATION_POLICY, Policy).put(key, policy)

    async def alerts(self) -> dict[str, Alert]:
        found = await self.bus.bucket(names.BUCKET_ALERTS, Alert).snapshot()
        return {k: v.value for k, v in found.items()}

    async def recommendations(self) -> dict[str, Recommendation]:
        found = await self.bus.bucket(names.BUCKET_RECOMMENDATIONS, Recommendation).snapshot()
        return {k: v.value for k, v in found.items()}

    async def remediations(self, node: str | None = None) -> list[Remediation]:
        found = await self.bus.bucket(names.BUCKET_REMEDIATIONS, Remediation).snapshot()
        rems = [v.value for v in found.values() if node is None or v.value.node == node]
        return sorted(rems, key=lambda r: r.created_time)

    async def until(
        self,
        check: Callable[[], Awaitable[bool]],
        timeout: float = 10.0,
        scan: bool = True,
    ) -> None:
        """Scan the machines and wait until `check` holds."""
        deadline = asyncio.get_running_loop().time() + timeout
        while asyncio.get_running_loop().time() < deadline:
            if scan:
                await self.scan()
            if await check():
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"{check.__name__} did not hold within {timeout}s")

    async def remediation_in(
        self, node: str, *states: RemediationState, timeout: float = 10.0
    ) -> Remediation:
        found: list[Remediation] = []

        async def reached() -> bool:
            found[:] = [r for r in await self.remediations(node) if r.state in states]
            return bool(found)

        await self.until(reached, timeout)
        return found[-1]


def readonly_report(node: str) -> SignalReport:
    """What the monitor publishes for a node whose root filesystem went read-only (NPD)."""
    t = now()
    evidence = Evidence(
        kind=AlertKind.READONLY_FILESYSTEM,
        source="npd",
        node=node,
        where=f"/state/machines/{node}/npd.json",
        observed_time=t,
        severity="critical",
        lines=[
            '{"reason": "FilesystemIsReadOnly", "status": "True", "type": "ReadonlyFilesystem"}'
        ],
    )
    return SignalReport(
        node=node,
        source="npd",
        observed_time=t,
        findings=[
            Finding(
                kind=AlertKind.READONLY_FILESYSTEM,
                subject="/",
                severity="critical",
                detail="FilesystemIsReadOnly",
                evidence=evidence,
            )
        ],
    )

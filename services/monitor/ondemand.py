"""The monitor's on-demand diagnostics (R15, R18): `nodus.node.<node>.req.diagnose` runs every
detector from scratch over the node's inputs, on the machine whose inputs they are, for the
remediator's revalidation. One slow input (a BMC-less DCGM URL, a blocked log) is bounded: the
answer says it did not finish instead of never coming."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from datetime import datetime

from libs.bus import Endpoint
from libs.contracts import names
from libs.contracts.base import now as utc_now
from libs.contracts.providers import HealthCheckReply, HealthCheckRequest
from services.monitor.detectors.machine import SOURCES, MachinePaths, diagnose

DIAGNOSE_SECONDS = 20.0  # the remediator waits 30 s for the answer


def finding_text(kind: str, subject: str, detail: str) -> str:
    """How a failed check reads in a remediation's diagnostics (the same for every provider)."""
    return f"{kind} {subject}: {detail}"


class Diagnostics:
    def __init__(
        self,
        machines: dict[str, MachinePaths],
        clock: Callable[[], datetime] = utc_now,
        bound: float = DIAGNOSE_SECONDS,
    ) -> None:
        self.machines = machines
        self.clock = clock
        self.bound = bound

    def endpoints(self) -> list[Endpoint[HealthCheckRequest, HealthCheckReply]]:
        def handler(node: str) -> Callable[[HealthCheckRequest], Awaitable[HealthCheckReply]]:
            async def handle(_: HealthCheckRequest) -> HealthCheckReply:
                return await self.run(node)

            return handle

        return [
            Endpoint(
                f"diagnose-{node}",
                names.node_request(node, names.AgentVerb.DIAGNOSE),
                HealthCheckRequest,
                handler(node),
            )
            for node in self.machines
        ]

    async def run(self, node: str) -> HealthCheckReply:
        t = self.clock()
        try:
            found = await asyncio.wait_for(
                asyncio.to_thread(diagnose, node, self.machines[node], t), self.bound
            )
            failures = [finding_text(f.kind.value, f.subject, f.detail) for f in found]
        except TimeoutError:
            failures = [f"monitor: the detectors did not finish within {self.bound:g} s"]
        return HealthCheckReply(
            node=node,
            boot_id="",
            healthy=not failures,
            failures=failures,
            checks=[f"detector {source}" for source in SOURCES],
            checked_time=self.clock(),
        )

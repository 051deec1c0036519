"""The agent's own health check, answered on the machine for the remediator's revalidation
(R15, R18): the agent answers from the boot it runs on, and its state directory takes a write
(a root filesystem gone read-only fails it). The detectors' part is the machine's monitor's
(`services.monitor.ondemand`)."""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path

from libs.contracts.base import now
from libs.contracts.providers import HealthCheckReply, HealthCheckRequest

CHECK_SECONDS = 10.0


def _write_probe(directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=directory, prefix=".health.")
    try:
        os.write(fd, b"ok\n")
        os.fsync(fd)
    finally:
        os.close(fd)
        os.unlink(name)


class AgentHealth:
    def __init__(self, node: str, state_dir: Path) -> None:
        self.node = node
        self.state_dir = state_dir

    async def check(self, _: HealthCheckRequest, boot_id: str) -> HealthCheckReply:
        failures: list[str] = []
        try:
            await asyncio.wait_for(asyncio.to_thread(_write_probe, self.state_dir), CHECK_SECONDS)
        except TimeoutError:
            failures.append(
                f"agent: a write to {self.state_dir} did not finish in {CHECK_SECONDS:g} s"
            )
        except OSError as error:
            failures.append(f"agent: {self.state_dir} takes no write: {error.strerror}")
        return HealthCheckReply(
            node=self.node,
            boot_id=boot_id,
            healthy=not failures,
            failures=failures,
            checks=["agent answers", f"write {self.state_dir}"],
            checked_time=now(),
        )

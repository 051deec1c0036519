"""The gang-lifecycle tests' system: `LocalSystem` on a small fleet, and what they read of it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import yaml

from app.local import REPO, LocalSystem
from libs.bus import Bus
from libs.bus.server import free_port
from libs.client.client import Client
from libs.contracts import names
from libs.contracts.jobs import Job, Phase
from services.placer.config import DEFAULT_CONFIG

WORKLOAD = str(REPO / "examples" / "workloads" / "allreduce.py")
SAMPLE_SECONDS = 1.0
SLEEPER = "import sys, time; time.sleep(float(sys.argv[1]))"  # a rank that only runs
L4 = {"count": 1, "backend": "cuda", "model": "L4"}
H100 = {"count": 8, "backend": "cuda", "model": "H100"}


def vm_in_vpc(name: str, index: int) -> dict[str, Any]:
    """A VM of one provider region on one private network: members talk over 127.0.2.x."""
    return {
        "name": name,
        "provider": "aws",
        "region": "us-east-1",
        "regionClass": "us",
        "offering": "vm",
        "address": f"127.0.1.{index}",
        "privateNetwork": "lifecycle-vpc",
        "privateAddress": f"127.0.2.{index}",
        "privateInterface": "ens5",
        "pool": "h100",
        "cluster": "us",
        "accelerators": H100,
    }


def eu_machine(name: str, offering: str, index: int) -> dict[str, Any]:
    """An L4 machine in the eu region class; a container has no network device (Relayed)."""
    return {
        "name": name,
        "provider": "vast" if offering == "container" else "lambda",
        "region": "eu-central-1",
        "regionClass": "eu",
        "offering": offering,
        "address": f"127.0.1.{index}",
        "pool": "l4",
        "cluster": "eu",
        "accelerators": L4,
    }


@contextlib.asynccontextmanager
async def local_system(
    tmp_path: Path,
    machines: list[dict[str, Any]],
    heartbeat_timeout_seconds: float | None = None,
    sample_seconds: float = SAMPLE_SECONDS,
) -> AsyncIterator[tuple[LocalSystem, Client, Bus]]:
    """The whole system as processes on the fleet `machines`; always stopped on the way out."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump({"machines": machines}))
    config: Path | None = None
    if heartbeat_timeout_seconds is not None:
        settings = yaml.safe_load(DEFAULT_CONFIG.read_text())
        settings["heartbeatTimeoutSeconds"] = heartbeat_timeout_seconds
        config = tmp_path / "placer.yaml"
        config.write_text(yaml.safe_dump(settings))
    system = LocalSystem(
        fleet_path=fleet,
        state_dir=tmp_path / "state",
        nats_port=free_port(),
        probe_seconds=sample_seconds,
        heartbeat_seconds=0.5,
        placer_config=config,
    )
    await system.start(timeout=90)  # stops what it started if it fails
    client: Client | None = None
    bus: Bus | None = None
    try:
        client = await Client.connect(system.url)
        bus = await Bus.open(system.url, name="lifecycle-test", buckets=names.ALL_BUCKETS)
        yield system, client, bus
    finally:
        if bus is not None:
            await bus.close()
        if client is not None:
            await client.close()
        system.stop()


async def wait_job(
    client: Client,
    system: LocalSystem,
    name: str,
    until: Callable[[Job], bool],
    timeout: float,
    what: str,
) -> Job:
    """Poll the job until `until` holds; on timeout say what it looked like and where logs are."""
    deadline = time.monotonic() + timeout
    last: Job | None = None
    while time.monotonic() < deadline:
        last = await client.get_job(name)
        if until(last):
            return last
        await asyncio.sleep(0.1)
    status = last.status if last else None
    raise AssertionError(
        f"{name}: {what} did not happen within {timeout:g}s; last status {status}; "
        f"logs in {system.state_dir / 'logs'}"
    )


def ended(job: Job) -> bool:
    return job.status.phase in (Phase.SUCCEEDED, Phase.FAILED)


async def rank_reports(client: Client, name: str, ranks: int) -> list[dict[str, Any]]:
    """The last line of every rank's log (`nodus logs NAME --rank N`): the workload's report."""
    reports = []
    for rank in range(ranks):
        logs = await client.logs(name, rank)
        lines = logs.data.strip().splitlines()
        assert lines, f"rank {rank} of {name} printed nothing"
        reports.append(json.loads(lines[-1]))
    return reports


# -- a. four members, Private path ---------------------------------------------------------------

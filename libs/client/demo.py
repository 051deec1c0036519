"""`nodus demo`: the system up on the embedded fleet, the example jobs applied, their gangs
placed (one per path class) and the refusals shown with their reasons; then a clean stop."""

from __future__ import annotations

import asyncio
import sys
import tempfile
from pathlib import Path

from libs.bus.server import free_port
from libs.client.client import Client, load_jobs
from libs.client.local import REPO, LocalSystem
from libs.client.output import table
from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.jobs import Job, Phase

JOBS_DIR = REPO / "examples" / "jobs"
SHOWN_ENV = (
    "NODUS_GANG_TRANSPORT",
    "MASTER_ADDR",
    "PET_RDZV_ENDPOINT",
    "NCCL_SOCKET_IFNAME",
    "NODUS_COLLECTIVES",
    "LD_PRELOAD",
    "NODUS_NETSHIM_PEERS",
)


def say(text: str = "") -> None:
    print(text, flush=True)


async def _wait_placed(client: Client, job: Job, timeout: float = 30.0) -> Job:
    async def wait() -> Job:
        async for current in client.watch_job(job.metadata.name, job.metadata.org):
            if current.status.phase in (Phase.PLACED, Phase.RUNNING, Phase.SUCCEEDED, Phase.FAILED):
                return current
        raise NodusError(ErrorCode.NOT_FOUND, f"job {job.metadata.name} was deleted")

    return await asyncio.wait_for(wait(), timeout)


async def run_demo() -> int:
    with tempfile.TemporaryDirectory(prefix="nodus-demo-") as state:
        system = LocalSystem(state_dir=Path(state), nats_port=free_port(), heartbeat_seconds=1.0)
        say(
            "== nodus up: nats-server (JetStream), placer, one agent per machine of examples/fleet.yaml"
        )
        await system.start()
        say(f"NODUS_NATS_URL={system.url}")
        client = await Client.connect(system.url)
        try:
            return await _run(client)
        finally:
            await client.close()
            system.stop()
            say("== stopped everything")


async def _run(client: Client) -> int:
    nodes = await client.list_nodes()
    say(f"== {len(nodes)} machines registered")
    placed: list[Job] = []
    refused: list[tuple[str, str]] = []
    unexpected: list[str] = []
    for path in sorted(JOBS_DIR.glob("*.yaml")):
        expect_refusal = path.name.startswith("refused-")
        try:
            jobs = load_jobs(path)
            for job in jobs:
                await client.apply(job)
                say(f"$ nodus apply -f examples/jobs/{path.name}\njob/{job.metadata.name} created")
                placed.append(job)
                if expect_refusal:
                    unexpected.append(f"{path.name} was admitted")
        except NodusError as error:
            say(f"$ nodus apply -f examples/jobs/{path.name}\nrefused: {error}")
            refused.append((path.name, str(error)))
            if not expect_refusal:
                unexpected.append(f"{path.name} was refused: {error}")
    results = [await _wait_placed(client, job) for job in placed]
    say("\n$ nodus get jobs")
    say(
        table(
            ["NAME", "ORG", "PHASE", "EPOCH", "TRANSPORT", "NODES"],
            [
                [
                    j.metadata.name,
                    j.metadata.org,
                    j.status.phase.value,
                    str(j.status.epoch),
                    j.status.gang.transport.value if j.status.gang else "-",
                    ",".join(m.node for m in j.status.gang.members) if j.status.gang else "-",
                ]
                for j in results
            ],
        )
    )
    for job in results:
        say(f"\n$ nodus env {job.metadata.name} --rank 1   (excerpt)")
        env = await client.rank_env(job.metadata.name, 1, job.metadata.org)
        for key in SHOWN_ENV:
            if key in env:
                say(f"{key}={env[key]}")
        if job.status.gang and job.status.gang.estimate and job.status.gang.estimate.warning:
            say(f"# warning: {job.status.gang.estimate.warning}")
    transports = {j.status.gang.transport.value for j in results if j.status.gang}
    for wanted in ("private", "direct", "relayed"):
        if wanted not in transports:
            unexpected.append(f"no gang on the {wanted} path")
    if not refused:
        unexpected.append("no job was refused")
    if unexpected:
        say("\nDEMO FAILED: " + "; ".join(unexpected))
        return 1
    say(
        f"\n== {len(results)} gangs placed ({', '.join(sorted(transports))}), {len(refused)} jobs refused"
    )
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(run_demo()))

"""`nodus demo`: the system up on the embedded fleet, the example jobs applied, their gangs
placed (one per path class) and the refusals shown with their reasons; then a clean stop.

With --netns, as root on a machine with what the network lab needs, every machine is a network
namespace (examples/fleet-netns.yaml) and the Direct gang runs too, over nodus0; otherwise the
demo says why not and shows it placed only."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import tempfile
from pathlib import Path

from app.local import REPO, LocalSystem
from app.netlab import missing_requirements
from app.output import jsonpath, table
from libs.bus.server import free_port
from libs.client.client import Client, job_document, load_jobs
from libs.contracts import names
from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.jobs import Job, Phase

JOBS_DIR = REPO / "examples" / "jobs"
NETNS_FLEET = REPO / "examples" / "fleet-netns.yaml"
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
            if current.status.epoch >= 1:  # placed at least once (a probe may send it back)
                return current
        raise NodusError(ErrorCode.NOT_FOUND, f"job {job.metadata.name} was deleted")

    return await asyncio.wait_for(wait(), timeout)


async def run_demo(
    state_dir: Path | None = None, netns: bool = False, nats_cluster: int = 1
) -> int:
    """The demo in a temporary state dir, or in `state_dir` (kept: its logs/, for tests);
    with `netns`, in the network-namespace lab when this machine has what it needs."""
    if state_dir is not None:
        return await _run_demo(state_dir, netns, nats_cluster)  # LocalSystem.start creates it
    with tempfile.TemporaryDirectory(prefix="nodus-demo-") as state:
        return await _run_demo(Path(state), netns, nats_cluster)


def lab_unavailable() -> str | None:
    """Why the demo cannot run its machines in network namespaces here, or None."""
    reason = missing_requirements()
    if reason is None:
        absent = [t for t in ("wireguard-go", "conntrack") if shutil.which(t) is None]
        reason = f"the Direct path needs {', '.join(absent)}" if absent else None
    return reason


async def _run_demo(state: Path, netns: bool, nats_cluster: int) -> int:
    skipped = (
        lab_unavailable()
        if netns
        else "the embedded default shares one network namespace (nodus demo --netns runs it)"
    )
    if skipped is None:
        system = LocalSystem(
            fleet_path=NETNS_FLEET,
            state_dir=state,
            nats_port=names.NATS_PORT,
            heartbeat_seconds=1.0,
            probe_seconds=2.0,
            netns=True,
            nats_cluster=nats_cluster,
        )
        say(
            "== nodus up --netns: every machine of examples/fleet-netns.yaml in a network "
            "namespace of its own (providers' LANs, NAT); nats-server (JetStream), placer, "
            "runner and two meshed relays in the lab's control namespace"
        )
    else:
        system = LocalSystem(
            state_dir=state,
            nats_port=0 if nats_cluster > 1 else free_port(),
            heartbeat_seconds=1.0,
            probe_seconds=2.0,
            nats_cluster=nats_cluster,
        )
        say(
            "== nodus up: nats-server (JetStream), placer, runner, two meshed relays, "
            "one agent per machine of examples/fleet.yaml"
        )
        say(f"# the Direct gang will be shown placed only: {skipped}")
    await system.start()
    assert system.nats is not None
    say(f"NODUS_NATS_URL={system.url}")
    say(f"NODUS_CREDENTIALS={system.nats.credentials}")
    client = await Client.connect(system.url, system.nats.credentials)
    try:
        return await _run(client, run_direct=skipped is None)
    finally:
        await client.close()
        system.stop()
        say("== stopped everything")


async def _run(client: Client, run_direct: bool) -> int:
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
    say(
        f"\n== {len(results)} gangs placed ({', '.join(sorted(transports))}), {len(refused)} jobs refused"
    )
    for job in results:
        if job.status.gang and job.status.gang.transport.value == "direct" and not run_direct:
            # The Direct path runs WireGuard on a nodus0 device per machine; without the lab
            # the machines share this host's network namespace, so it is shown placed only.
            await client.delete(job.metadata.name, job.metadata.org)
            say(
                f"$ nodus delete job {job.metadata.name}   # Direct needs a nodus0 device per machine"
            )
    ran = []
    for job in results:
        if not job.status.gang or (job.status.gang.transport.value == "direct" and not run_direct):
            continue
        ran.append(job.status.gang.transport.value)
        unexpected += await _run_to_the_end(client, job)
    if unexpected:
        say("\nDEMO FAILED: " + "; ".join(unexpected))
        return 1
    say(f"\n== the workload ran on the {', the '.join(sorted(ran))} gang, verified on every rank")
    return 0


async def _run_to_the_end(client: Client, job: Job, timeout: float = 180.0) -> list[str]:
    """Probe, launch, run: wait for the end, then show the probe, the workload and the bill."""
    name, org = job.metadata.name, job.metadata.org

    async def wait() -> Job:
        async for current in client.watch_job(name, org):
            if current.status.phase in (Phase.SUCCEEDED, Phase.FAILED):
                return current
        raise NodusError(ErrorCode.NOT_FOUND, f"job {name} was deleted")

    done = await asyncio.wait_for(wait(), timeout)
    say(f"\n$ nodus get job {name} -o jsonpath='{{.status.phase}} {{.status.gang.probe}}'")
    document = job_document(done)
    say(jsonpath("{.status.phase} {.status.gang.probe}", document))
    problems = []
    for rank in range(done.spec.distributed.members):
        logs = await client.logs(name, rank, 0, org)
        last = logs.data.strip().splitlines()[-1] if logs.data.strip() else ""
        say(f"$ nodus logs {name} --rank {rank} | tail -1\n{last}")
        try:
            if not json.loads(last).get("verified"):
                problems.append(f"{name} rank {rank} did not verify its all-reduce")
        except ValueError:
            problems.append(f"{name} rank {rank} printed no report")
    billing = done.status.billing
    if billing:
        say(
            f"# billing: boot {billing.boot_seconds:.1f}s, run {billing.run_seconds:.1f}s, "
            f"mesh-relay {billing.mesh_relay_gi_b:.4f} GiB"
        )
    if done.status.phase is not Phase.SUCCEEDED:
        reasons = "; ".join(
            f"{c.type.value}={c.reason}: {c.message}" for c in done.status.conditions
        )
        problems.append(f"{name} ended {done.status.phase.value}: {reasons}")
    return problems


if __name__ == "__main__":
    sys.exit(asyncio.run(run_demo()))

"""Issue 26 on real processes: Relayed gangs of more than two members.

- A 4-member Relayed job is refused, naming the qualification it lacks, until `nodus qualify
  --path relayed --members 4` has measured a gang of 4 on those offerings; then it runs.
- A 4-member Relayed gang runs torchrun with PyTorch's Gloo backend across every member
  through the shim, its members spread over both relays, and Succeeds, verified on every rank,
  with the relay carrying rank 0 SIGKILLed mid-run.
- 8 members each sending to the next at once: tests/bench/test_relayed_gang_bench.py (the bench,
  as a user runs it, measures and checks them).

Each test has a system of its own (a module's shared system would measure the machine).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
import time
from pathlib import Path

import pytest
import yaml

from app.local import REPO
from libs.client.client import Client
from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.jobs import Job, Phase
from services.placer.config import DEFAULT_CONFIG
from tests.e2e import relayed_lab
from tests.e2e.joblogs import json_lines, rank_log
from tests.e2e.nodus_cli import nodus
from tests.e2e.relayed_lab import (
    Lab,
    containers,
    new_system,
    start_lab,
)
from tests.factories import job

pytestmark = pytest.mark.slow

GLOO = REPO / "examples" / "workloads" / "gloo_allreduce.py"
ALLREDUCE = ["python3", str(REPO / "examples" / "workloads" / "allreduce.py")]


def placer_config(path: Path, relayed_max_members: int) -> Path:
    """The shipped placer config, with the operator's limit on Relayed gangs raised."""
    config = yaml.safe_load(DEFAULT_CONFIG.read_text())
    config["relayedMaxMembers"] = relayed_max_members
    path.write_text(yaml.safe_dump(config))
    return path


async def wait_ended(client: Client, name: str, timeout: float = 300.0) -> Job:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = await client.get_job(name)
        if found.status.phase in (Phase.SUCCEEDED, Phase.FAILED):
            return found
        await asyncio.sleep(0.5)
    raise AssertionError(f"{name} not ended within {timeout:g} s: {found.status}")


def test_a_four_member_relayed_job_runs_once_a_gang_of_four_is_qualified(tmp_path: Path) -> None:
    system = new_system(tmp_path, containers("rq", 71, 4))
    four = job(
        "four",
        org="acme",
        command=ALLREDUCE,
        env={"ALLREDUCE_MIB": "4", "ALLREDUCE_ITERS": "2"},
        accelerators={"model": "L4"},
        distributed={"members": 4, "transport": "Auto"},
    )

    async def refused(client: Client) -> NodusError:
        with pytest.raises(NodusError) as refusal:
            await client.apply(four)
        return refusal.value

    async def run(client: Client) -> tuple[Job, list[str]]:
        await client.apply(four)
        ended = await wait_ended(client, "four")
        return ended, [await rank_log(client, "four", rank) for rank in range(4)]

    lab = Lab(system, "four")
    try:
        asyncio.run(system.start(timeout=90))
        error = lab.run(refused)
        assert error.code is ErrorCode.RELAYED_MEMBERS, error
        assert "nodus qualify --path relayed --members 4" in str(error), error
        done = nodus(
            "qualify",
            *("--path", "relayed", "--members", "4", "--offerings", "container+container"),
            *("--mib", "4", "-o", "json", "--nats", system.url),
        )
        assert done.returncode == 0, done.stdout + done.stderr
        record = json.loads(done.stdout)
        assert record["ok"] and record["members"] == 4, record
        assert record["pair"] == "vast/container+vast/container" and len(record["machines"]) == 4
        assert record["tcpGbps"] > 0 and record["allreduceBusGbps"] > 0, record
        ended, logs = lab.run(run)
        assert ended.status.phase is Phase.SUCCEEDED, (ended.status.conditions, logs)
        gang = ended.status.gang
        assert gang is not None and gang.transport.value == "relayed", gang
        for rank, text in enumerate(logs):
            assert any(line.get("verified") for line in json_lines(text)), (rank, text[-2000:])
    finally:
        system.stop()


def test_a_four_member_relayed_gang_runs_torchrun_gloo_through_a_relay_kill(
    tmp_path: Path,
) -> None:
    assert importlib.util.find_spec("torch") is not None, (
        "PyTorch is not installed in this venv: `make test` installs it (pip install -e '.[torch]')"
    )
    iterations = 12
    system = new_system(tmp_path, relayed_lab.fleet("rg", 61, members=4))
    system.placer_config = placer_config(tmp_path / "placer.yaml", 4)  # the operator's override
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", str(GLOO)]
    env = {
        "GLOO_ALLREDUCE_MIB": "16",
        "GLOO_ALLREDUCE_ITERS": str(iterations),
        "GLOO_ALLREDUCE_TIMEOUT": "120",
    }
    try:
        lab = asyncio.run(start_lab(system, "gloo4", command, env=env, members=4))
        homes = {member.node: lab.home_relay(member.node) or "" for member in lab.members}
        assert sorted(homes.values()) == sorted(lab.relays() * 2), homes  # 2 on each relay

        async def rank0_iteration(client: Client) -> int:
            lines = json_lines(await rank_log(client, "gloo4", 0))
            return max((line["iteration"] for line in lines if "iteration" in line), default=-1)

        deadline = time.monotonic() + 180
        while lab.run(rank0_iteration) < 2:  # mid-run: a few all-reduces done
            assert lab.get_job().status.phase is Phase.RUNNING, lab.get_job().status
            assert time.monotonic() < deadline, "rank 0 did not reach its third all-reduce"
            time.sleep(0.2)
        killed = lab.kill_home_relay()
        lab.restart_relay(killed)

        async def ended_and_logs(client: Client) -> tuple[Job, list[str]]:
            ended = await wait_ended(client, "gloo4")
            return ended, [await rank_log(client, "gloo4", rank) for rank in range(4)]

        ended, texts = lab.run(ended_and_logs)
        assert ended.status.phase is Phase.SUCCEEDED, (
            f"{ended.status.phase.value} after {killed} was killed: {ended.status.conditions}; "
            f"rank logs (ends): {[t[-2000:] for t in texts]}; logs in {system.state_dir / 'logs'}"
        )
        for rank, text in enumerate(texts):
            final = [line for line in json_lines(text) if "verified" in line]
            assert final and final[-1]["verified"] and final[-1]["iterations"] == iterations, (
                f"rank {rank} did not verify {iterations} all-reduces: {text[-2000:]}"
            )
    finally:
        system.stop()

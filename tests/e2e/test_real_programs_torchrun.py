"""Done-when of issue 9, torchrun: a 2-member Relayed job whose command is torchrun with
PyTorch's Gloo backend (the CPU wheel `make test` installs) all-reduces 64 MiB tensors 20 times
(examples/workloads/gloo_allreduce.py); the relay carrying rank 0's traffic is SIGKILLed in
the middle; the job Succeeds and every rank's log (`nodus logs NAME --rank N`) shows its
results verified.

A module of its own, not part of test_real_programs.py: the job runs to completion on a
system of its own, and that module's shared system would otherwise still be running (two
systems at once on a small machine measure the machine, not the dataplane).
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys
import time
from pathlib import Path

import pytest

from app.local import REPO
from libs.client.client import Client
from libs.contracts.jobs import Job, Phase
from tests.e2e import relayed_lab
from tests.e2e.joblogs import json_lines, rank_log
from tests.e2e.relayed_lab import new_system, start_lab

pytestmark = pytest.mark.slow

ITERATIONS = 20
MIB = 64
WORKLOAD = REPO / "examples" / "workloads" / "gloo_allreduce.py"


def test_f_torchrun_gloo_allreduce_survives_a_relay_kill_and_succeeds(tmp_path: Path) -> None:
    assert importlib.util.find_spec("torch") is not None, (
        "PyTorch is not installed in this venv: `make test` installs it (pip install -e '.[torch]')"
    )
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1"]
    env = {
        "GLOO_ALLREDUCE_MIB": str(MIB),
        "GLOO_ALLREDUCE_ITERS": str(ITERATIONS),
        "GLOO_ALLREDUCE_TIMEOUT": "120",  # a wedged collective fails the job, not the test run
    }
    system = new_system(tmp_path, relayed_lab.fleet("tr", 51))
    try:
        lab = asyncio.run(start_lab(system, "gloo", [*command, str(WORKLOAD)], env=env))

        async def rank0_iteration(client: Client) -> int:
            lines = json_lines(await rank_log(client, "gloo", 0))
            return max((line["iteration"] for line in lines if "iteration" in line), default=-1)

        middle = ITERATIONS // 2 - 1
        deadline = time.monotonic() + 180
        while (reached := lab.run(rank0_iteration)) < middle:
            job = lab.get_job()
            assert job.status.phase is Phase.RUNNING, (
                f"the job left Running at iteration {reached}: {job.status.phase} "
                f"{job.status.conditions}"
            )
            assert time.monotonic() < deadline, f"rank 0 reached only iteration {reached} in 180 s"
            time.sleep(0.2)
        killed = lab.kill_home_relay()

        async def until_ended(client: Client) -> Job:
            end = time.monotonic() + 300
            while time.monotonic() < end:
                job = await client.get_job("gloo")
                if job.status.phase in (Phase.SUCCEEDED, Phase.FAILED):
                    return job
                await asyncio.sleep(0.5)
            status = (await client.get_job("gloo")).status
            raise AssertionError(f"not ended 300 s after relay {killed} was killed: {status}")

        ended = lab.run(until_ended)

        async def logs(client: Client) -> list[str]:
            return [await rank_log(client, "gloo", rank) for rank in range(2)]

        texts = lab.run(logs)
        assert ended.status.phase is Phase.SUCCEEDED, (
            f"the torchrun job is {ended.status.phase.value} after relay {killed} was killed "
            f"at iteration {middle}: {ended.status.conditions}; rank logs (ends): "
            f"{[t[-3000:] for t in texts]}; logs in {system.state_dir / 'logs'}"
        )
        for rank, text in enumerate(texts):
            final = [line for line in json_lines(text) if "verified" in line]
            assert final and final[-1]["verified"] and final[-1]["iterations"] == ITERATIONS, (
                f"rank {rank} did not verify {ITERATIONS} all-reduces: {text[-3000:]}"
            )
            print(f"rank {rank}: {final[-1]} ({killed} killed after iteration {middle})")
    finally:
        system.stop()

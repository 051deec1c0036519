"""Done-when of issue 22, part 1: an agent restart is not a reboot (O4).

A Relayed gang (a container and a VM: the shim, the tunnel through two relays) and a Direct
gang (two VMs in the network-namespace lab, one behind NAT: nodus0 and wireguard-go) run
iperf3 (`-P 2`, 20 s) and torchrun + Gloo. While each job runs, every member's agent is
stopped and started again, one after the other, twice:

- SIGKILL, then started again as `nodus up`'s supervision does (a crash);
- SIGTERM, waited for, then started again (a rolling upgrade of every agent).

Both in the same job: a job that lives through both lives through each, and four jobs take
half the time of eight.

What a user would notice, checked: iperf3 exits 0 and no 1-s interval delivered nothing;
torchrun Succeeds with every all-reduce verified; the job's epoch is still 1 (the gang was not
placed again); no daemon log holds an error (tests/e2e/conftest.py). The lab's reboot, which is
a new boot, still ends the epoch at once: tests/e2e/test_lab_repairs.py.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from app.demo import lab_unavailable
from app.local import REPO, LocalSystem
from libs.bus.server import free_port
from libs.client.client import Client
from libs.contracts import names
from libs.contracts.jobs import Job, Phase
from libs.contracts.lifecycle import JoinedEpochsReply, JoinedEpochsRequest
from services.agent.private.member import PortRules
from tests.e2e import relayed_lab
from tests.e2e.joblogs import json_lines, rank_log
from tests.e2e.netns_lab import lab_system
from tests.e2e.relayed_lab import new_system
from tests.factories import job

pytestmark = pytest.mark.slow

IPERF = str(REPO / "tests" / "e2e" / "programs" / "iperf_gang.py")
GLOO = str(REPO / "examples" / "workloads" / "gloo_allreduce.py")
IPERF_SECONDS = 20  # room for four restarts (each agent crashed, then upgraded), 2-3 s each
# Two VMs on one provider's private network (another model: the Direct jobs never land there).
PRIVATE_MACHINES = [
    ("ar-vpc-1", "198.18.7.11", "198.18.107.11"),
    ("ar-vpc-2", "198.18.7.12", "198.18.107.12"),
]
DIRECT_MACHINES = [
    ("ar-east", "lambda", "198.18.3.1", False),
    ("ar-west", "crusoe", "198.19.6.1", True),
]


def run(system: LocalSystem, work: Any) -> Any:
    async def body() -> Any:
        client = await Client.connect(system.url)
        try:
            return await work(client)
        finally:
            await client.close()

    return asyncio.run(body())


def apply_and_wait_running(system: LocalSystem, spec: Job, limit: float = 120) -> Job:
    async def work(client: Client) -> Job:
        await client.apply(spec)
        deadline = time.monotonic() + limit
        while True:
            current = await client.get_job(spec.metadata.name)
            if current.status.phase is Phase.RUNNING:
                return current
            assert current.status.phase not in (Phase.FAILED, Phase.SUCCEEDED), current.status
            assert time.monotonic() < deadline, (
                f"{spec.metadata.name} not Running in {limit:g}s: {current.status}; "
                f"logs in {system.state_dir / 'logs'}"
            )
            await asyncio.sleep(0.2)

    found: Job = run(system, work)
    return found


def wait_until(system: LocalSystem, name: str, rank: int, predicate: Any, limit: float) -> None:
    """Until a JSON line of the rank's log satisfies `predicate`; the job must stay Running."""

    async def work(client: Client) -> None:
        deadline = time.monotonic() + limit
        while True:
            if any(predicate(line) for line in json_lines(await rank_log(client, name, rank))):
                return
            current = await client.get_job(name)
            assert current.status.phase is Phase.RUNNING, (
                f"{name} left Running: {current.status}; rank {rank}: "
                f"{(await rank_log(client, name, rank))[-2000:]}"
            )
            assert time.monotonic() < deadline, f"{name}: rank {rank} never got there"
            await asyncio.sleep(0.2)

    run(system, work)


def rejoined(system: LocalSystem, node: str, gang: str, epoch: int, limit: float = 30) -> float:
    """Until the agent of `node` answers again and says it is in the gang's epoch (it adopted
    it); returns how long that took."""
    started = time.monotonic()

    async def work(client: Client) -> None:
        while True:
            try:
                reply = await client.bus.request(
                    names.node_request(node, names.AgentVerb.EPOCHS),
                    JoinedEpochsRequest(),
                    JoinedEpochsReply,
                    timeout=1.0,
                )
                if any((e.gang, e.epoch) == (gang, epoch) for e in reply.epochs):
                    return
            except Exception:  # not answering yet: it is starting
                pass
            assert time.monotonic() - started < limit, f"agent of {node} never came back"
            await asyncio.sleep(0.1)

    run(system, work)
    return time.monotonic() - started


HOW = ("SIGKILL", "SIGTERM")


def restart_agents(system: LocalSystem, nodes: list[str], how: str, gang: str) -> list[float]:
    """Every member's agent, one after the other: SIGKILLed and started again by the system's
    supervision (a crash), or SIGTERMed, waited for and started again (a rolling upgrade), or
    (`how` "both") the one and then the other. Returns how long each took to be back in its
    epoch."""
    if how == "both":
        return [t for way in HOW for t in restart_agents(system, nodes, way, gang)]
    back = []
    for node in nodes:
        child = system.child(f"agent-{node}")
        if how == "SIGKILL":
            os.kill(child.process.pid, signal.SIGKILL)
            child.process.wait(10)
            restarted = system.restart_exited()
            assert (f"agent-{node}", -signal.SIGKILL) in restarted, restarted
        else:
            system.restart(f"agent-{node}")  # SIGTERM, wait, start: what an upgrade does
            assert child.process.returncode == 0, (
                f"agent of {node} exited {child.process.returncode}"
            )
        back.append(rejoined(system, node, gang, 1))
    return back


def wait_ended(system: LocalSystem, name: str, limit: float) -> Job:
    async def work(client: Client) -> Job:
        deadline = time.monotonic() + limit
        while True:
            current = await client.get_job(name)
            if current.status.phase in (Phase.SUCCEEDED, Phase.FAILED):
                return current
            assert time.monotonic() < deadline, f"{name} not ended in {limit:g}s: {current.status}"
            await asyncio.sleep(0.3)

    ended: Job = run(system, work)
    return ended


def logs_of(system: LocalSystem, name: str) -> list[str]:
    async def work(client: Client) -> list[str]:
        return [await rank_log(client, name, rank) for rank in range(2)]

    texts: list[str] = run(system, work)
    return texts


Restart = Callable[[LocalSystem, list[str], str, str], list[float]]


def iperf_through_restarts(
    system: LocalSystem,
    transport: str,
    name: str,
    how: str,
    model: str = "L4",
    restart: Restart = restart_agents,
) -> list[str]:
    """iperf3 between the gang's ranks while `restart` restarts their agents; returns the
    members' nodes by rank."""
    spec = job(
        name,
        org="acme",
        command=[sys.executable, IPERF, str(free_port()), str(IPERF_SECONDS), "2"],
        accelerators={"model": model},
        distributed={"members": 2, "transport": transport},
    )
    placed = apply_and_wait_running(system, spec)
    gang = f"acme.{name}"
    assert placed.status.gang is not None
    nodes = [m.node for m in sorted(placed.status.gang.members, key=lambda m: m.rank)]
    wait_until(system, name, 1, lambda line: line.get("event") == "client-start", 60)
    time.sleep(3)
    back = restart(system, nodes, how, gang)
    ended = wait_ended(system, name, IPERF_SECONDS + 90)
    texts = logs_of(system, name)
    results = [line["iperf"] for line in json_lines(texts[1]) if "iperf" in line]
    detail = f"rank logs {[t[-1500:] for t in texts]}; logs in {system.state_dir / 'logs'}"
    assert results, f"iperf3 left no result: {detail}"
    result = results[-1]
    print(f"{name} ({transport}, agents {how}, back after {back} s): {result}")
    assert result["exit"] == 0, f"iperf3 failed: {result}; {detail}"
    assert len(result["intervals"]) >= IPERF_SECONDS and result["zeroIntervals"] == 0, result
    assert ended.status.phase is Phase.SUCCEEDED, f"{ended.status}; {detail}"
    assert ended.status.epoch == 1, f"the gang was placed again: epoch {ended.status.epoch}"
    return nodes


def torchrun_through_restarts(system: LocalSystem, transport: str, name: str, how: str) -> None:
    iterations = 30
    spec = job(
        name,
        org="acme",
        command=[sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", GLOO],
        env={
            "GLOO_ALLREDUCE_MIB": "32",
            "GLOO_ALLREDUCE_ITERS": str(iterations),
            "GLOO_ALLREDUCE_TIMEOUT": "120",
        },
        accelerators={"model": "L4"},
        distributed={"members": 2, "transport": transport},
    )
    placed = apply_and_wait_running(system, spec)
    gang = f"acme.{name}"
    assert placed.status.gang is not None
    nodes = [m.node for m in sorted(placed.status.gang.members, key=lambda m: m.rank)]
    wait_until(system, name, 0, lambda line: line.get("iteration", -1) >= 1, 120)
    back = restart_agents(system, nodes, how, gang)
    ended = wait_ended(system, name, 300)
    texts = logs_of(system, name)
    detail = f"rank logs {[t[-2000:] for t in texts]}; logs in {system.state_dir / 'logs'}"
    print(f"{name} ({transport}, agents {how}, back after {back} s): {ended.status.phase}")
    assert ended.status.phase is Phase.SUCCEEDED, f"{ended.status}; {detail}"
    assert ended.status.epoch == 1, f"the gang was placed again: epoch {ended.status.epoch}"
    for rank, text in enumerate(texts):
        final = [line for line in json_lines(text) if "verified" in line]
        assert final and final[-1]["verified"] and final[-1]["iterations"] == iterations, (
            f"rank {rank} did not verify {iterations} all-reduces: {detail}"
        )


# -- the Relayed path: a container and a VM on this host ----------------------------------------


@pytest.fixture(scope="module")
def relayed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSystem]:
    system = new_system(tmp_path_factory.mktemp("agent-restart"), relayed_lab.fleet("ar", 61))
    try:
        asyncio.run(system.start(timeout=90))
        yield system
    finally:
        system.stop()


# -- the Direct path: two VMs of the network-namespace lab, one behind NAT ----------------------


@pytest.fixture(scope="module")
def direct(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSystem]:
    unavailable = lab_unavailable()
    if unavailable is not None:
        pytest.skip(str(unavailable))
    root = tmp_path_factory.mktemp("agent-restart-direct")
    system = lab_system(root, DIRECT_MACHINES, PRIVATE_MACHINES)
    try:
        asyncio.run(system.start(timeout=90))
        yield system
    finally:
        system.stop()


PATHS = {"relayed": ("Auto", "rl"), "direct": ("Direct", "dr")}


@pytest.mark.parametrize("program", ["iperf3", "torchrun"])
@pytest.mark.parametrize("path", ["relayed", "direct"])
def test_a_gang_outlives_its_agents_crashing_and_upgrading_in_the_same_epoch(
    request: pytest.FixtureRequest, path: str, program: str
) -> None:
    system: LocalSystem = request.getfixturevalue(path)  # the path's module-wide system
    transport, prefix = PATHS[path]
    name = f"{prefix}-{program[:5]}"
    if program == "iperf3":
        iperf_through_restarts(system, transport, name, "both")
    else:
        assert importlib.util.find_spec("torch") is not None, "`make test` installs PyTorch"
        torchrun_through_restarts(system, transport, name, "both")


def test_a_private_gang_keeps_its_port_rules_as_they_are_through_its_agents_restarting(
    direct: LocalSystem,
) -> None:
    """G22's rules are kernel state the next agent adopts, not rewrites: each member's
    nftables table is the same table (same handle, same rules) after its agent was SIGKILLed
    and started again, and iperf3 over the private network never stalled. The rules go when
    the job ends."""
    lab = direct.lab
    assert lab is not None
    table = PortRules("acme.pv-iperf", 1, "ens5", (), 0, (0, 0)).table

    def listed(node: str) -> str:
        argv = lab.machine_argv(node, ["nft", "-a", "list", "table", "inet", table])
        done = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
        return done.stdout if done.returncode == 0 else f"absent: {done.stderr.strip()}"

    def restart_and_compare(
        system: LocalSystem, nodes: list[str], how: str, gang: str
    ) -> list[float]:
        before = {node: listed(node) for node in nodes}
        assert all("handle" in text for text in before.values()), before
        back = restart_agents(system, nodes, how, gang)
        after = {node: listed(node) for node in nodes}
        assert after == before, f"the port rules were rewritten: {before} -> {after}"
        return back

    nodes = iperf_through_restarts(
        direct, "Direct", "pv-iperf", "SIGKILL", model="A10", restart=restart_and_compare
    )
    assert sorted(nodes) == sorted(n for n, _, _ in PRIVATE_MACHINES)
    deadline = time.monotonic() + 15
    while not all(listed(node).startswith("absent") for node in nodes):
        assert time.monotonic() < deadline, "the port rules outlived the job"
        time.sleep(0.2)

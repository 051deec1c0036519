"""The Direct path end to end (issue 11), with `nodus up --netns`: two VMs of different
providers, one behind its provider's NAT, each in a network namespace of its own, agents
creating `nodus0` and finding each other with ICE.

- torchrun with PyTorch's Gloo all-reduces over `nodus0` (GLOO_SOCKET_IFNAME=nodus0, the mesh
  addresses) and the job Succeeds with every rank verified; the probe said `direct`.
- UDP cut in one VM's namespace while a job runs: `NetworkDegraded` turns True within 10 s
  naming the pair; restoring UDP turns it False; the job Succeeds (its ranks never noticed).
- No error in any daemon's log.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.demo import lab_unavailable
from app.local import REPO, LocalSystem
from libs.client.client import Client
from libs.contracts.jobs import ConditionType, Job, Phase
from tests.e2e.daemon_logs import DaemonLogs
from tests.e2e.netns_lab import lab_system
from tests.e2e.nodus_cli import nodus
from tests.factories import job
from tests.integration.lab_programs import seen_by

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(lab_unavailable() is not None, reason=str(lab_unavailable())),
]

MACHINES = [("vm-east", "lambda", "198.18.3.1", False), ("vm-west", "crusoe", "198.19.6.1", True)]
# Three VMs on one provider's private network (another accelerator model, so the Direct jobs
# never land there): a 2-member Private gang leaves one of them a non-member on its network.
PRIVATE = [(f"vpc-{i}", f"198.18.7.{i}", f"198.18.107.{i}") for i in (1, 2, 3)]
CUT = """table inet nodus_test_cut {
  chain out { type filter hook output priority filter; oifname "eth0" meta l4proto udp drop; }
  chain in { type filter hook input priority filter; iifname "eth0" meta l4proto udp drop; }
}
"""


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSystem]:
    local = lab_system(tmp_path_factory.mktemp("direct"), MACHINES, PRIVATE)
    try:
        asyncio.run(local.start(timeout=90))
        yield local
    finally:
        local.stop()


def _run(system: LocalSystem, work: object) -> object:
    async def go() -> object:
        client = await Client.connect(system.url)
        try:
            return await work(client)  # type: ignore[operator]
        finally:
            await client.close()

    return asyncio.run(go())


def _apply_and_wait(
    system: LocalSystem, spec: Job, phases: set[Phase], limit: float, apply: bool = True
) -> Job:
    async def work(client: Client) -> Job:
        if apply:
            await client.apply(spec)
        deadline = time.monotonic() + limit
        while True:
            current = await client.get_job(spec.metadata.name, spec.metadata.org)
            if current.status.phase in phases:
                return current
            assert time.monotonic() < deadline, (
                f"{spec.metadata.name}: {current.status}; logs in {system.state_dir / 'logs'}"
            )
            await asyncio.sleep(0.25)

    found = _run(system, work)
    assert isinstance(found, Job)
    return found


def _logs(system: LocalSystem, name: str) -> list[str]:
    async def work(client: Client) -> list[str]:
        texts = []
        for rank in range(2):
            text, offset = "", 0
            while (reply := await client.logs(name, rank, offset, org="acme")).data:
                text, offset = text + reply.data, reply.offset
            texts.append(text)
        return texts

    found = _run(system, work)
    assert isinstance(found, list)
    return found


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="make test installs torch")
def test_torchrun_gloo_allreduces_over_nodus0(system: LocalSystem, daemon_logs: DaemonLogs) -> None:
    daemon_logs.watch(system.state_dir / "logs")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1"]
    spec = job(
        "gloo-direct",
        command=[*command, str(REPO / "examples" / "workloads" / "gloo_allreduce.py")],
        env={
            "GLOO_ALLREDUCE_MIB": "16",
            "GLOO_ALLREDUCE_ITERS": "10",
            "GLOO_ALLREDUCE_TIMEOUT": "120",
        },
        accelerators={"model": "L4"},
        distributed={"members": 2, "transport": "Direct"},
    )
    ended = _apply_and_wait(system, spec, {Phase.SUCCEEDED, Phase.FAILED}, 240)
    texts = _logs(system, "gloo-direct")
    assert ended.status.phase is Phase.SUCCEEDED, (ended.status.conditions, texts)
    gang = ended.status.gang
    assert gang is not None and gang.probe is not None and gang.probe.path == "direct", gang
    for rank, text in enumerate(texts):
        final = [json.loads(line) for line in text.splitlines() if line.startswith('{"')]
        verified = [line for line in final if "verified" in line]
        assert verified and verified[-1]["verified"], f"rank {rank}: {text[-2000:]}"
        print(f"rank {rank}: {verified[-1]}")


def until_released(marker: Path, most: float) -> list[str]:
    """A rank's command that runs until the test creates `marker` (the machines share this
    host's files), at most `most` seconds: the job lasts as long as the test needs it."""
    wait = (
        "import os, sys, time; end = time.monotonic() + float(sys.argv[2])\n"
        "while not os.path.exists(sys.argv[1]) and time.monotonic() < end: time.sleep(0.2)"
    )
    return [sys.executable, "-c", wait, str(marker), f"{most:g}"]


def test_udp_cut_sets_network_degraded_and_restoring_clears_it(
    system: LocalSystem, daemon_logs: DaemonLogs, tmp_path: Path
) -> None:
    daemon_logs.watch(system.state_dir / "logs")
    released = tmp_path / "released"
    spec = job(
        "steady",
        command=until_released(released, 90),
        accelerators={"model": "L4"},
        distributed={"members": 2, "transport": "Direct"},
    )
    running = _apply_and_wait(system, spec, {Phase.RUNNING}, 120)
    assert running.status.gang is not None and running.status.gang.probe is not None
    assert running.status.gang.probe.path == "direct"
    assert system.lab is not None
    machine = MACHINES[0][0]
    subprocess.run(
        system.lab.machine_argv(machine, ["nft", "-f", "-"]), input=CUT, text=True, check=True
    )
    cut = time.monotonic()

    def degraded(state: str, limit: float) -> tuple[float, str]:
        async def work(client: Client) -> tuple[float, str]:
            while time.monotonic() - cut < limit + 60:
                current = await client.get_job("steady")
                condition = current.condition(ConditionType.NETWORK_DEGRADED)
                if condition is not None and condition.status == state:
                    return time.monotonic() - cut, condition.message
                await asyncio.sleep(0.2)
            raise AssertionError(f"NetworkDegraded never {state}: {current.status.conditions}")

        found = _run(system, work)
        assert isinstance(found, tuple)
        return found

    after, message = degraded("True", 10)
    assert after <= 10, f"NetworkDegraded True only {after:.1f} s after the cut"
    assert all(name in message for name, *_ in MACHINES), message
    subprocess.run(
        system.lab.machine_argv(machine, ["nft", "delete", "table", "inet", "nodus_test_cut"]),
        check=True,
    )
    cut = time.monotonic()
    back, _ = degraded("False", 40)
    released.touch()
    ended = _apply_and_wait(system, spec, {Phase.SUCCEEDED, Phase.FAILED}, 60, apply=False)
    assert ended.status.phase is Phase.SUCCEEDED, ended.status.conditions
    print(f"NetworkDegraded True {after:.1f} s after the cut, False {back:.1f} s after the restore")


def test_udp_blocked_from_the_start_replaces_direct_and_continues_auto_as_relayed(
    system: LocalSystem, daemon_logs: DaemonLogs
) -> None:
    """G12: a pair that cannot go peer to peer (UDP blocked in one VM's namespace before the
    gang exists) fails the Direct epoch's probe: a Direct gang is placed again without that
    machine (here: nowhere, so it waits), an Auto gang continues as Relayed and Succeeds."""
    daemon_logs.watch(system.state_dir / "logs")
    assert system.lab is not None
    machine = MACHINES[1][0]
    argv = system.lab.machine_argv(machine, ["nft", "-f", "-"])
    subprocess.run(argv, input=CUT, text=True, check=True)
    try:
        sleep = [sys.executable, "-c", "import time; time.sleep(2)"]
        direct = job(
            "blocked-direct",
            command=sleep,
            accelerators={"model": "L4"},
            distributed={"members": 2, "transport": "Direct"},
        )

        def refused(current: Job) -> bool:
            condition = current.condition(ConditionType.NETWORK_QUALIFIED)
            return condition is not None and condition.reason == "ProbeFailed"

        async def wait_refused(client: Client) -> Job:
            await client.apply(direct)
            deadline = time.monotonic() + 120
            while not refused(current := await client.get_job("blocked-direct")):
                assert time.monotonic() < deadline, current.status
                await asyncio.sleep(0.25)
            await client.delete("blocked-direct")
            return current

        found = _run(system, wait_refused)
        assert isinstance(found, Job)
        condition = found.condition(ConditionType.NETWORK_QUALIFIED)
        assert condition is not None and "derp:" in condition.message, condition
        assert found.status.phase is Phase.PENDING and found.status.avoid, found.status

        auto = job(
            "blocked-auto",
            command=sleep,
            accelerators={"model": "L4"},
            distributed={"members": 2, "transport": "Auto"},
        )
        ended = _apply_and_wait(system, auto, {Phase.SUCCEEDED, Phase.FAILED}, 180)
        assert ended.status.phase is Phase.SUCCEEDED, ended.status.conditions
        gang = ended.status.gang
        assert gang is not None and gang.transport.value == "relayed", gang
        assert gang.probe is not None and gang.probe.path.startswith("derp:"), gang.probe
    finally:
        subprocess.run(
            system.lab.machine_argv(machine, ["nft", "delete", "table", "inet", "nodus_test_cut"]),
            check=False,
        )


def test_private_ports_open_to_the_gang_s_members_only_while_it_runs(
    system: LocalSystem, daemon_logs: DaemonLogs, tmp_path: Path
) -> None:
    """G22: while a Private gang runs, a listener on an ephemeral port of a member's private
    address takes the other member's connection and refuses the non-member's on the same
    network; once the gang ended, the non-member's connection is taken (the rules went)."""
    daemon_logs.watch(system.state_dir / "logs")
    assert system.lab is not None
    lab = system.lab
    released = tmp_path / "released"
    spec = job(
        "on-the-vpc",
        command=until_released(released, 60),
        accelerators={"model": "A10"},
        distributed={"members": 2, "transport": "Auto"},
    )
    running = _apply_and_wait(system, spec, {Phase.RUNNING}, 120)
    gang = running.status.gang
    assert gang is not None and gang.transport.value == "private", gang

    async def members(client: Client) -> list[str]:
        epoch = await client.epoch(running)
        return sorted(m.node for m in epoch.members)

    placed = _run(system, members)
    assert isinstance(placed, list)
    private = {name: address for name, _, address in PRIVATE}
    outsider = next(name for name in private if name not in placed)
    target, other = placed

    def connect(client: str) -> str:
        return seen_by(
            lab.machine_argv(target, []),
            private[target],
            lab.machine_argv(client, []),
            private[target],
            port=40123,  # in the ephemeral range: where NCCL and Gloo listen
        )

    assert connect(other) == private[other]
    assert connect(outsider) == "refused"
    released.touch()
    ended = _apply_and_wait(system, spec, {Phase.SUCCEEDED, Phase.FAILED}, 60, apply=False)
    assert ended.status.phase is Phase.SUCCEEDED, ended.status.conditions
    deadline = time.monotonic() + 15
    while (seen := connect(outsider)) != private[outsider]:
        assert time.monotonic() < deadline, f"still {seen} after the gang ended"
        time.sleep(0.5)


def test_nodus_qualify_measures_a_pair_and_records_it(
    system: LocalSystem, daemon_logs: DaemonLogs
) -> None:
    """G21: `nodus qualify` runs the probe and the example all-reduce on a pair of machines
    of the types asked for, on that path, and `nodus get qualifications` shows the run."""
    daemon_logs.watch(system.state_dir / "logs")
    bus = ["--nats", system.url]
    done = nodus(
        "qualify",
        *("--path", "direct", "--offerings", "lambda/vm+crusoe/vm", "--mib", "8", "-o", "json"),
        *bus,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads(done.stdout)
    assert record["ok"] and record["path"] == "direct", record
    assert record["pair"] == "crusoe/vm+lambda/vm"
    assert sorted(record["machines"]) == sorted(name for name, *_ in MACHINES)
    assert record["tcpGbps"] > 0 and record["rttMs"] > 0 and record["allreduceBusGbps"] > 0
    shown = nodus("get", "qualifications", *bus, timeout=30)
    assert shown.returncode == 0, shown.stderr
    assert "crusoe/vm+lambda/vm" in shown.stdout and "yes" in shown.stdout, shown.stdout

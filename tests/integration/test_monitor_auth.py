"""S1 for a machine's monitor, on a real nats-server: `nodus monitor --node NODE`, the daemon as
systemd and the DaemonSet start it, on its own bus user (`monitor-NODE`, which `nodus bus user
--agent NODE` writes beside the agent's), reports its machine's signals, asks its machine's
agent whether it answers and runs its detectors when the remediator asks; it can do nothing of
another machine's, nor forge its own machine's heartbeat or take its agent's requests. Given
another user (its agent's: one seed copied to both units) it does not start, and says why.
Before, both units loaded one seed, so on a real machine the monitor's every report was refused
(or the agent ran with every Nodus subject)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import nats.errors
import pytest
from nats.aio.msg import Msg

from app.lab import faults
from libs.bus import Bus
from libs.bus.auth import AGENT, MONITOR, monitor_inbox
from libs.bus.server import NatsServer
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.fleet import NodeHealth
from libs.contracts.providers import HealthCheckReply, HealthCheckRequest
from tests.integration.test_bus_auth import REFUSAL_WAIT, Confined, connect_confined
from tests.kmsg_support import REPO, MonitorProcess, SignalWatch, remediation_bus

NODE = "gpu-a"


@pytest.fixture
async def bus(nats_server: NatsServer) -> AsyncIterator[Bus]:
    """The operator's connection; it makes the buckets, the remediator's among them."""
    async with remediation_bus(nats_server.url) as opened:
        yield opened


@pytest.fixture
async def monitor_a(nats_server: NatsServer, bus: Bus) -> AsyncIterator[Confined]:
    confined = await connect_confined(
        nats_server, nats_server.user(f"monitor-{NODE}", MONITOR, NODE), monitor_inbox(NODE)
    )
    yield confined
    await confined.nc.close()


def machine_inputs(tmp_path: Path) -> Path:
    directory = tmp_path / "machine"
    faults.ensure_baseline(directory, gpus=2, ib_ports=1)
    (directory / "kern.log").write_text("")  # a kernel log file: the device needs no root here
    return directory


async def test_a_machines_monitor_does_its_machines_work_on_its_own_user(
    nats_server: NatsServer, bus: Bus, tmp_path: Path
) -> None:
    seed = nats_server.user(f"monitor-{NODE}", MONITOR, NODE)
    machine = machine_inputs(tmp_path)
    asked: list[str] = []  # its agent's requests, as the agent would receive them

    async def agent_asked(msg: Msg) -> None:
        asked.append(msg.subject)

    agent = await bus.nc.subscribe(names.node_request(NODE, names.AgentVerb.INFO), cb=agent_asked)
    # Its agent's heartbeat (the agent is not run here): the monitor reads its boot id.
    beat = NodeHealth(node=NODE, healthy=True, heartbeat_time=now(), boot_id="boot-of-a")
    await bus.bucket(names.BUCKET_HEALTH, NodeHealth).put(NODE, beat)
    watch = SignalWatch(bus, NODE)
    await watch.start()
    monitor = MonitorProcess(
        nats_server.url,
        NODE,
        machine,
        tmp_path / "logs",
        kmsg=str(machine / "kern.log"),
        extra=["--credentials", seed, "--interval", "0.2", "--unreachable-seconds", "1"],
        reachability=True,
    )
    monitor.start()
    try:
        for source in ("kmsg", "dcgm"):  # its reports land, with its machine's boot id
            await watch.until(source, lambda report: report.boot_id == "boot-of-a", timeout=30)
        for _ in range(100):  # it asks its agent whether it answers
            if asked:
                break
            await asyncio.sleep(0.1)
        assert asked, "the monitor's reachability request never reached its agent"
        # The remediator's revalidation runs its detectors on the machine (R15).
        reply = await bus.request(
            names.node_request(NODE, names.AgentVerb.DIAGNOSE),
            HealthCheckRequest(),
            HealthCheckReply,
            timeout=30,
        )
        assert reply.node == NODE and reply.checks
    finally:
        code = monitor.stop()
        await watch.stop()
        await agent.unsubscribe()
    assert code == 0
    logs = "".join(p.read_text() for p in (tmp_path / "logs").glob("*.log"))
    assert "permissions violation" not in logs.lower(), logs


async def test_a_monitor_cannot_report_for_another_machine_or_forge_its_own_heartbeat(
    monitor_a: Confined,
) -> None:
    js = monitor_a.nc.jetstream(timeout=REFUSAL_WAIT)
    assert (await js.publish(f"$KV.nodus-signals.{NODE}.kmsg", b"{}")).seq > 0
    for subject in ("$KV.nodus-signals.gpu-b.kmsg", f"$KV.nodus-health.{NODE}"):
        with pytest.raises(nats.errors.TimeoutError):
            await js.publish(subject, b"{}")
        assert await monitor_a.refused(subject)


async def test_a_monitor_cannot_take_or_send_its_agents_requests_or_read_join_keys(
    monitor_a: Confined,
) -> None:
    # Its agent's requests (launch a rank, stop an epoch) are the agent's alone.
    await monitor_a.nc.subscribe(f"nodus.node.{NODE}.req.>")
    assert await monitor_a.refused(f'subscription to "nodus.node.{NODE}.req.>"')
    await monitor_a.nc.publish(names.node_request(NODE, names.AgentVerb.LAUNCH), b"{}")
    assert await monitor_a.refused(f"nodus.node.{NODE}.req.launch")
    await monitor_a.nc.subscribe("_INBOX.>")
    assert await monitor_a.refused('subscription to "_inbox.>"')
    with pytest.raises(nats.errors.TimeoutError):
        await monitor_a.nc.request(
            f"$JS.API.DIRECT.GET.KV_nodus-joinkeys.$KV.nodus-joinkeys.{NODE}.acme.train.1",
            b"",
            timeout=REFUSAL_WAIT,
        )
    assert await monitor_a.refused("kv_nodus-joinkeys")


@pytest.mark.parametrize("whose", ["its agent's", "another machine's monitor's"])
def test_a_monitor_given_another_user_does_not_start_and_says_why(
    nats_server: NatsServer, tmp_path: Path, whose: str
) -> None:
    if whose == "its agent's":
        seed = nats_server.user(f"agent-{NODE}", AGENT, NODE)
    else:
        seed = nats_server.user("monitor-gpu-b", MONITOR, "gpu-b")
    machine = machine_inputs(tmp_path)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "app",
            "monitor",
            "--nats",
            nats_server.url,
            "--credentials",
            seed,
            "--node",
            NODE,
            "--kmsg",
            str(machine / "kern.log"),
            "--dcgm",
            str(machine / "dcgm.prom"),
            "--no-reachability",
            "--metrics-port",
            "0",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0
    assert f"it is not {NODE}'s monitor user" in done.stderr, done.stderr
    assert f"nodus bus user --agent {NODE}" in done.stderr

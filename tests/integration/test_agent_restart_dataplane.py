"""An agent restart is not a reboot (O4), on real agent processes: a Relayed gang's TCP stream
keeps delivering while its agents are SIGTERMed and SIGKILLed and started again (the dataplane
runs in a process of its own, which the next agent re-adopts); a dataplane that dies on its own
is started again with the same key; an epoch fenced while its agent was down is stopped when
the agent starts; a dataplane of another boot is killed, not adopted."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from libs.bus import Bus
from libs.bus.server import NatsServer
from libs.client.client import Client
from libs.contracts.jobs import Phase
from services.agent import procs
from services.agent.boot import new_lab_boot
from services.relay.relay import Relay
from tests.conftest import StartPlacer, eventually
from tests.e2e.daemon_logs import DaemonLogs
from tests.integration.agent_daemons import (
    AgentDaemon,
    Stream,
    agent_daemons,
    end_gang,
    joined,
    place_relayed_gang,
)
from tests.integration.conftest import meshed_relays

GAP = 1.0  # "no gap of seconds": the stream's echoes are 10 ms apart


@pytest.fixture
async def lab(
    bus: Bus, nats_server: NatsServer, start_placer: StartPlacer, tmp_path: Path
) -> AsyncIterator[list[AgentDaemon]]:
    relays: list[Relay] = await meshed_relays(bus)
    daemons = await agent_daemons(nats_server, tmp_path, "rs", 61)
    await start_placer()
    await place_relayed_gang(bus, daemons)
    yield daemons
    await end_gang(bus, "rs", daemons, relays)
    findings = DaemonLogs([tmp_path / "logs"]).read_new()
    assert not findings, "\n".join(str(f) for f in findings)


async def _homed(bus: Bus, daemon: AgentDaemon) -> bool:
    """The agent answers, and its epoch's tunnel is homed on a relay."""
    return any(e.relay for e in await joined(bus, daemon.node))


async def _alive(bus: Bus, daemon: AgentDaemon) -> None:
    async def answers() -> bool:
        return await _homed(bus, daemon)

    await eventually(answers, timeout=20)


async def test_a_stream_in_the_tunnel_survives_agents_stopped_and_killed(
    bus: Bus, lab: list[AgentDaemon]
) -> None:
    a, b = lab
    planes = {d.node: d.dataplane() for d in lab}
    assert all(planes.values())
    stream = Stream(a.socks, b.address)
    await stream.start()
    try:
        await asyncio.sleep(0.5)
        began = time.monotonic()
        for daemon, sig in ((a, signal.SIGTERM), (b, signal.SIGKILL), (a, signal.SIGKILL)):
            daemon.signal(sig)
            await asyncio.sleep(1.0)  # no agent runs; the tunnel does
            daemon.start()
            await _alive(bus, daemon)
        await asyncio.sleep(1.0)
        assert stream.error is None, stream.error
        assert stream.longest_gap(since=began) < GAP, stream.longest_gap(since=began)
        # The same processes carried it all along: adopted, never started again.
        assert {d.node: d.dataplane() for d in lab} == planes
        assert all(procs.alive(p.pid, p.start_ticks) for p in planes.values() if p)
        # Same epoch: the restarts were no reboots (the placer compares boot ids).
        status = (await Client(bus).get_job("rs")).status
        assert status.epoch == 1 and status.phase is not Phase.FAILED
        # The dataplane's series are on the agent's /metrics.
        metrics = await asyncio.to_thread(
            lambda: (
                urllib.request.urlopen(f"http://127.0.0.1:{a.metrics_port}/metrics").read().decode()
            )
        )
        assert f'nodus_agent_tunnel_streams{{node="{a.node}"}} 1.0' in metrics
        assert "nodus_agent_socks_requests_total" in metrics
        assert "nodus_agent_heartbeats_total" in metrics
    finally:
        await stream.close()
    assert (a.log_dir / f"dataplane-{a.epoch_dirs()[0].name}.log").exists()


async def test_a_dataplane_that_dies_is_started_again_with_the_same_key(
    bus: Bus, lab: list[AgentDaemon]
) -> None:
    a, b = lab
    before = a.dataplane()
    assert before is not None
    os.kill(before.pid, signal.SIGKILL)

    async def started_again() -> bool:
        now = a.dataplane()
        return now is not None and now.pid != before.pid and await _homed(bus, a)

    await eventually(started_again, timeout=20)
    # A new connection through the tunnel: the peer still knows this member's key.
    stream = Stream(a.socks, b.address)
    await stream.start()
    try:
        await eventually(_received(stream, 20), timeout=10)
    finally:
        await stream.close()


def _received(stream: Stream, count: int) -> Callable[[], Awaitable[bool]]:
    async def enough() -> bool:
        return stream.received >= count

    return enough


async def test_an_epoch_fenced_while_its_agent_was_down_is_stopped_at_start(
    bus: Bus, lab: list[AgentDaemon]
) -> None:
    a, _ = lab
    a.signal(signal.SIGKILL)
    plane = a.dataplane()
    assert plane is not None
    await Client(bus).delete("rs")  # fenced and deleted while no agent of `a` runs
    a.start()

    async def forgotten() -> bool:
        return not a.epoch_dirs() and not procs.alive(plane.pid, plane.start_ticks)

    await eventually(forgotten, timeout=20)


async def test_a_dataplane_of_another_boot_is_killed_not_adopted(
    bus: Bus, lab: list[AgentDaemon]
) -> None:
    a, _ = lab
    plane = a.dataplane()
    assert plane is not None
    a.signal(signal.SIGKILL)
    new_lab_boot(a.state_dir)  # the lab machine booted again
    a.start()

    async def killed() -> bool:
        return not procs.alive(plane.pid, plane.start_ticks)

    await eventually(killed, timeout=20)
    # Not adopted: the placer ends the epoch (its member booted again) and places the gang
    # anew; whatever runs here now is another process.
    assert a.dataplane() != plane

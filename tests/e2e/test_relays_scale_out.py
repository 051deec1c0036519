"""Which relays a Relayed gang gets, on real processes (nats-server, placer, runner, meshed
relays, an agent per machine with its dataplane):

- with four relays (one per core of two relay hosts, say), two gangs get two relays each, the
  least loaded, and carry their probes through them; every relay holds the sessions of one
  gang's members, instead of the first two relays holding all of them and the others idle,
  though the four share one port for members and the kernel hands a connection to any;
- a gang placed while one of two relays is down still gets both: its members home on the
  live one, connect to the other once it is back, and fail over to it (before, such a gang
  had one relay, and no failover, for its whole life);
- iperf3 through the shim outlives both of its gang's relays being SIGKILLed for good (their
  host lost): its members move to the third relay and iperf3 exits 0 with bytes moving after
  the move (before, it stalled until its own timeout)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from libs.bus.server import free_port
from libs.contracts.relay import RELAY_FRESH_SECONDS
from services.agent.relayed.homing import RESCUE_SECONDS
from tests.e2e.nodus_cli import nodus_on
from tests.e2e.relayed_lab import containers, new_system, program_env, start_lab, start_server

pytestmark = pytest.mark.slow


def get_relays(url: str, *flags: str) -> str:
    return nodus_on(url, "get", "relays", *flags).stdout


def test_two_gangs_on_four_relays_use_two_each(tmp_path: Path) -> None:
    system = new_system(tmp_path, containers("so", 61, 4))
    system.relays = 4
    try:
        first = asyncio.run(start_lab(system, "so", ["sleep", "3600"]))
        second = asyncio.run(start_lab(system, "sp", ["sleep", "3600"], started=True))
        for lab in (first, second):  # Relayed from the first epoch: no Direct to fall from
            assert lab.get_job().status.epoch == 1
        relays_of = {}
        for lab in (first, second):
            gang = lab.get_job().status.gang
            assert gang is not None and len(gang.relays) == 2, gang
            relays_of[lab.job_name] = set(gang.relays)
            homes = {m.node: lab.home_relay(m.node) for m in lab.members}
            # Each member homes on its gang's relays, one member on each (the placer's choice).
            assert set(homes.values()) == set(gang.relays), (lab.job_name, homes, gang.relays)
        assert relays_of["so"].isdisjoint(relays_of["sp"]), relays_of
        # Every relay carries one gang: its two members (each keeps its failover's session).
        sessions = {r: first.metric(r, "nodus_relay_sessions") for r in first.relays()}
        assert sessions == {f"relay-{i}": 2 for i in range(4)}, sessions
        # The four share one port for members (as on a relay host's 443): the kernel gave most
        # connections to another relay first, which handed each to the relay its member named.
        handed = sum(first.metric(r, "nodus_relay_handoffs_total") for r in first.relays())
        assert handed > 0
        # The operator sees the same spread: one member homed on each relay, live.
        shown = json.loads(get_relays(system.url, "-o", "json"))
        assert [
            (r["name"], r["live"], r["members"], r["capMbps"], len(r["gangs"])) for r in shown
        ] == [(f"relay-{i}", True, 1, 500, 1) for i in range(4)], shown
        assert len({r["sharedAddress"] for r in shown}) == 1  # where every member dialled
        assert "MEMBERS" in get_relays(system.url)
    finally:
        system.stop()


def test_members_home_on_the_relay_of_their_region(tmp_path: Path) -> None:
    # Containers in two regions; a relay in each, and two in regions no machine is in (idle,
    # so the least loaded). Wherever the placer puts the gangs' members (a gang may span both
    # regions), each member homes on the relay of its own region.
    doc = containers("sr", 71, 4)
    for index, machine in enumerate(doc["machines"]):
        region, region_class = [("eu-south-1", "eu"), ("us-east-2", "us")][index % 2]
        machine.update(region=region, regionClass=region_class)
    system = new_system(tmp_path, doc)
    system.relays = 4
    system.relay_regions = ["eu-south-1", "us-east-2", "ap-south-1", "ap-northeast-1"]
    relay_of = {"eu-south-1": "relay-0", "us-east-2": "relay-1"}
    region_of = {m["name"]: m["region"] for m in doc["machines"]}
    try:
        first = asyncio.run(start_lab(system, "sr", ["sleep", "3600"]))
        second = asyncio.run(start_lab(system, "ss", ["sleep", "3600"], started=True))
        for lab in (first, second):
            homes = {m.node: lab.home_relay(m.node) for m in lab.members}
            assert homes == {n: relay_of[region_of[n]] for n in homes}, (lab.job_name, homes)
        shown = json.loads(get_relays(system.url, "-o", "json"))
        assert {r["name"]: r["members"] for r in shown} == {
            "relay-0": 2,
            "relay-1": 2,
            "relay-2": 0,
            "relay-3": 0,
        }, shown
    finally:
        system.stop()


def test_a_gang_placed_while_a_relay_is_down_fails_over_to_it_once_it_is_back(
    tmp_path: Path,
) -> None:
    system = new_system(tmp_path, containers("sq", 65, 2))
    try:
        asyncio.run(system.start(timeout=90))
        os.kill(system.child("relay-0").process.pid, signal.SIGKILL)
        time.sleep(RELAY_FRESH_SECONDS + 1.0)  # its last heartbeat ages out: it is not live
        lab = asyncio.run(start_lab(system, "sq", ["sleep", "3600"], started=True))
        gang = lab.get_job().status.gang
        assert gang is not None and gang.relays == ["relay-0", "relay-1"], gang
        assert {lab.home_relay(m.node) for m in lab.members} == {"relay-1"}
        # Back: both members connect to it (restart_relay waits for their sessions).
        lab.restart_relay("relay-0")
        lab.kill_relay("relay-1")
        deadline = time.monotonic() + 15.0
        homes: dict[str, str | None] = {}
        while time.monotonic() < deadline:
            homes = {m.node: lab.home_relay(m.node) for m in lab.members}
            if set(homes.values()) == {"relay-0"}:
                break
            time.sleep(0.2)
        assert set(homes.values()) == {"relay-0"}, homes
    finally:
        system.stop()


def test_iperf3_outlives_both_of_its_gangs_relays_lost(tmp_path: Path) -> None:
    system = new_system(tmp_path, containers("sx", 87, 2))
    system.relays = 3
    seconds = 16
    try:
        lab = asyncio.run(start_lab(system, "sx", ["sleep", "3600"]))
        gang = lab.get_job().status.gang
        assert gang is not None and len(gang.relays) == 2, gang
        (third,) = {f"relay-{i}" for i in range(3)} - set(gang.relays)
        port, host = free_port(), lab.server.address
        server = ["iperf3", "-s", "-B", host, "-p", str(port), "-1"]
        with start_server(server, tmp_path / "iperf3-server.log", port):
            client = subprocess.Popen(
                ["iperf3", "-c", host, "-p", str(port), "-t", str(seconds), "--json"],
                env=program_env(lab.client.env),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            try:
                time.sleep(3)
                for lost in gang.relays:  # for good: nothing starts them again
                    lab.kill_relay(lost)
                out, err = client.communicate(timeout=seconds + 45)
            finally:
                if client.poll() is None:
                    client.kill()
                    client.communicate()
        homes = {m.node: lab.home_relay(m.node) for m in lab.members}
        assert set(homes.values()) == {third}, (homes, gang.relays)
        report = json.loads(out) if out.startswith("{") else {}
        assert client.returncode == 0 and report and "error" not in report, (out[-2000:], err)
        # Bytes moved through the third relay after the members' wait, to the run's last second.
        # Not in every second: TCP resends on a timer that doubled while no relay was up (at
        # 6.2 s after the kill, then 12.6 s), so a rescue a little slower than 5 s leaves
        # seconds empty that no Nodus change could fill.
        after = [
            i["sum"]["bytes"] for i in report["intervals"] if i["sum"]["start"] > 4 + RESCUE_SECONDS
        ]
        assert after and after[-1] > 0, report["intervals"]
    finally:
        system.stop()

"""O1 on this machine: `nodus agent --node me --region r --provider p`, with no fleet file,
registers what this machine is: its real default-route interface's address, no accelerators
(it has none), and the offering kind found by trying (a tun device and UDP: a VM when it can
create them); a machine facts file fills in what the flags do not say."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from libs.bus import Bus
from libs.bus.server import NatsServer
from services.agent.discover import try_udp, try_wireguard_device
from tests.integration.described_agent import run_described_agent

REPO = Path(__file__).resolve().parents[2]
ENV = {k: v for k, v in os.environ.items() if k != "NODUS_FLEET"}  # no fleet file: discovery


def _default_address() -> str:
    route = json.loads(
        subprocess.run(
            ["ip", "-j", "route", "show", "default"], capture_output=True, text=True, check=True
        ).stdout
    )
    device = route[0]["dev"]
    addresses = json.loads(
        subprocess.run(
            ["ip", "-j", "-4", "addr", "show", "dev", device],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    return str(addresses[0]["addr_info"][0]["local"])


def test_an_agent_without_a_fleet_file_describes_this_machine(
    nats_server: NatsServer, bus: Bus, tmp_path: Path
) -> None:
    facts = tmp_path / "machine.yaml"
    facts.write_text("pool: cpu\ncluster: lab\nregionClass: eu\n")
    record, out, code = run_described_agent(nats_server, "me", facts, tmp_path / "me", ENV)
    inventory = record.inventory
    assert (inventory.provider, inventory.region, inventory.region_class) == ("p", "r", "eu")
    assert (inventory.pool, inventory.cluster) == ("cpu", "lab")
    assert inventory.address == _default_address()
    assert inventory.accelerators.count == 0 and inventory.accelerators.devices == []
    vm = try_wireguard_device() and try_udp()
    assert inventory.offering == ("vm" if vm else "container"), out
    assert ("wireguard-device" in record.capabilities) is vm
    assert code == 0, out


def test_an_agent_that_cannot_describe_its_machine_says_why(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "app",
            "agent",
            "--node",
            "me",
            "--region",
            "r",
            "--machine-file",
            str(tmp_path / "none.yaml"),
            "--nats",
            "nats://127.0.0.1:1",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
        env=ENV,
    )
    assert done.returncode != 0
    assert "cannot be described" in done.stderr + done.stdout and "provider" in (
        done.stderr + done.stdout
    )

"""The agent's Direct member on three lab VMs (one on a public address, two behind their own
providers' NATs): the bus and a real relay (with STUN) run in the lab's control namespace,
each member's `nodus0` finds every peer through ICE offers exchanged in `nodus-ice`, and
bytes cross every pair's mesh addresses intact, in both directions."""

from __future__ import annotations

import hashlib
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.demo import lab_unavailable
from app.netlab import NetLab
from tests.integration.direct_lab import direct_members
from tests.integration.lab_programs import lab_fleet, run_python, running_lab

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(lab_unavailable() is not None, reason=str(lab_unavailable())),
]

MACHINES = (
    ("lambda-a", "lambda", "198.18.2.1", False, "100.64.7.1"),
    ("home-b", "home", "198.19.3.1", True, "100.64.7.2"),
    ("cafe-c", "cafe", "198.19.4.1", True, "100.64.7.3"),
)
FLEET = lab_fleet(*((name, provider, address, nat) for name, provider, address, nat, _ in MACHINES))

ECHO = """
import hashlib, socket, sys
s = socket.create_server(("{address}", 7000))
print("ready", flush=True)
s.settimeout(20)
while True:
    conn, _ = s.accept()
    digest = hashlib.sha256()
    while chunk := conn.recv(1 << 16):
        digest.update(chunk)
    conn.sendall(digest.hexdigest().encode())
    conn.close()
"""

SEND = """
import socket
data = bytes.fromhex({block!r}) * 1024
with socket.create_connection(("{address}", 7000), timeout=20) as s:
    s.sendall(data)
    s.shutdown(socket.SHUT_WR)
    print(s.recv(100).decode())
"""


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[NetLab]:
    with running_lab(FLEET, tmp_path / "lab.json", reach_from_host=True) as netlab:
        yield netlab


def test_three_vms_two_behind_nat_join_over_nodus0_and_every_pair_carries_bytes(
    lab: NetLab, tmp_path: Path
) -> None:
    with direct_members(lab, tmp_path, [(m[0], m[2], m[4]) for m in MACHINES]) as members:
        reports = members.reports
        for name, report in reports.items():
            assert report["failures"] == {}, (name, report)
            assert set(report["paths"]) == {m[0] for m in MACHINES} - {name}
        # A NATed member is reached at its router's public address.
        routers = {lan.machines[0]: str(lan.uplink) for lan in lab.topology.lans if lan.nat}
        for name, report in reports.items():
            for peer, (remote, _) in report["paths"].items():
                if peer in routers:
                    assert remote[0] == routers[peer], (name, peer, remote)

        block = secrets.token_bytes(1024)  # 1 MiB a transfer
        digest = hashlib.sha256(block * 1024).hexdigest()
        for name, _, _, _, mesh in MACHINES:
            echo = subprocess.Popen(
                lab.machine_argv(name, [sys.executable, "-c", ECHO.format(address=mesh)]),
                stdout=subprocess.PIPE,
                text=True,
            )
            members.others.append(echo)
            assert echo.stdout is not None and echo.stdout.readline().strip() == "ready"
            for other, *_ in MACHINES:
                if other != name:
                    got = run_python(
                        lab.machine_argv(other, []),
                        SEND.format(block=block.hex(), address=mesh),
                        timeout=40,
                    )
                    assert got == digest, f"{other} -> {name}"
            echo.kill()

"""`nodus0` on two lab machines of different providers: wireguard-go devices made by the
agent's `Nodus0`, configured over UAPI, carry a TCP transfer between the mesh addresses
intact; the device reports the handshake and the bytes; after close the device is gone."""

from __future__ import annotations

import hashlib
import json
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.netlab import NetLab, missing_requirements
from libs.wg import generate_private_key, public_key
from tests.integration.lab_programs import REPO, lab_fleet, run_python, running_lab

reason = missing_requirements() or (None if shutil.which("wireguard-go") else "no wireguard-go")
pytestmark = pytest.mark.skipif(reason is not None, reason=str(reason))

FLEET = lab_fleet(
    ("aws-a", "aws", "198.18.1.1", False), ("lambda-a", "lambda", "198.18.2.1", False)
)

# A member's side: nodus0 up with its key and its peer, until stdin closes; then its state.
MEMBER = """
import asyncio, json, sys
from libs.wg.uapi import DeviceConfig, PeerConfig
from services.agent.direct.nodus0 import Nodus0, device_exists

async def main(private, address, peer_key, peer_address, peer_endpoint):
    device = Nodus0()
    await device.create(address, 10)
    await device.configure(DeviceConfig(
        private_key=bytes.fromhex(private), listen_port=51820,
        peers=(PeerConfig(bytes.fromhex(peer_key), (peer_address + "/32",), peer_endpoint, 5),),
    ))
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    state = await device.state()
    [peer] = state.peers.values()
    await device.close()
    print(json.dumps({"handshake": peer.last_handshake, "rx": peer.rx_bytes, "tx": peer.tx_bytes,
                      "port": state.listen_port, "gone": not device_exists("nodus0")}), flush=True)

asyncio.run(main(*sys.argv[1:]))
"""

SINK = """
import hashlib, socket
s = socket.create_server(("100.64.0.2", 7000))
print("ready", flush=True)
s.settimeout(10)
conn, _ = s.accept()
digest, size = hashlib.sha256(), 0
while chunk := conn.recv(1 << 16):
    digest.update(chunk); size += len(chunk)
print(size, digest.hexdigest(), flush=True)
"""

SOURCE = """
import socket, sys
data = bytes.fromhex(sys.argv[1]) * 4096
with socket.create_connection(("100.64.0.2", 7000), timeout=10) as s:
    s.sendall(data)
"""


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[NetLab]:
    with running_lab(FLEET, tmp_path / "lab.json", reach_from_host=False) as netlab:
        yield netlab


def _member(lab: NetLab, machine: str, *args: str) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        lab.machine_argv(machine, [sys.executable, "-c", MEMBER, *args]),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
    )
    assert process.stdout is not None
    assert process.stdout.readline().strip() == "ready"
    return process


def test_two_machines_talk_over_nodus0_and_the_device_goes_when_closed(lab: NetLab) -> None:
    a_key, b_key = generate_private_key(), generate_private_key()
    a = _member(
        lab,
        "aws-a",
        a_key.hex(),
        "100.64.0.1",
        public_key(b_key).hex(),
        "100.64.0.2",
        "198.18.2.1:51820",
    )
    b = _member(
        lab,
        "lambda-a",
        b_key.hex(),
        "100.64.0.2",
        public_key(a_key).hex(),
        "100.64.0.1",
        "198.18.1.1:51820",
    )
    sink = subprocess.Popen(
        lab.machine_argv("lambda-a", [sys.executable, "-c", SINK]),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert sink.stdout is not None and sink.stdout.readline().strip() == "ready"
        block = secrets.token_bytes(1024)  # 4 MiB in all
        run_python(
            lab.machine_argv("aws-a", []),
            SOURCE.replace("sys.argv[1]", repr(block.hex())),
            timeout=30,
        )
        size, digest = sink.stdout.readline().split()
        assert int(size) == len(block) * 4096
        assert digest == hashlib.sha256(block * 4096).hexdigest()
    finally:
        sink.kill()
        sink.wait()
    states = []
    for member in (a, b):
        out, _ = member.communicate(timeout=15)
        states.append(json.loads(out.strip().splitlines()[-1]))
    for state in states:
        assert state["handshake"] > 0 and state["port"] == 51820 and state["gone"]
    assert states[0]["tx"] > len(block) * 4096  # ciphertext and headers: more than the payload
    assert states[1]["rx"] > len(block) * 4096


LEFTOVER = """
import asyncio, os, subprocess, time
from services.agent.direct.nodus0 import Nodus0, device_exists

# An agent that died left its wireguard-go and nodus0 behind.
env = {**os.environ, "WG_I_PREFER_BUGGY_USERSPACE_TO_POLISHED_KMOD": "1"}
orphan = subprocess.Popen(["wireguard-go", "-f", "nodus0"], env=env)
while not device_exists("nodus0"):
    time.sleep(0.02)

async def main():
    device = Nodus0()
    await device.create("100.64.0.9", 24)
    address = subprocess.run(["ip", "-o", "-4", "addr", "show", "dev", "nodus0"],
                             capture_output=True, text=True).stdout
    await device.close()
    print("100.64.0.9/24" in address, orphan.wait(timeout=5) is not None, device_exists("nodus0"))

asyncio.run(main())
"""


def test_a_nodus0_left_by_a_dead_agent_is_replaced(lab: NetLab) -> None:
    out = run_python(lab.machine_argv("aws-a", []), LEFTOVER, timeout=20)
    assert out == "True True False", out

"""Two VMs, each behind its own provider's NAT, join over `nodus0`: ICE (aioice, with the
relay's STUN in the control namespace) finds the pair of server-reflexive addresses, WireGuard
sends from the ports the checks opened (services/agent/wgport.py), and a transfer between
the mesh addresses arrives intact. Real NAT routers (nftables masquerade), real wireguard-go."""

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

from app.netlab import CONTROL_ADDRESS, NetLab, in_namespace, missing_requirements
from libs.wg import generate_private_key, public_key
from tests.integration.lab_programs import ENV, REPO, lab_fleet, run_python, running_lab

reason = missing_requirements() or next(
    (f"no {tool}" for tool in ("wireguard-go", "conntrack") if shutil.which(tool) is None), None
)
pytestmark = pytest.mark.skipif(reason is not None, reason=str(reason))

FLEET = lab_fleet(("home-a", "home", "198.19.3.1", True), ("cafe-b", "cafe", "198.19.4.1", True))

STUN = """
import asyncio
from services.relay.stun import StunServer

async def main():
    server = StunServer("{host}", 3478)
    await server.start()
    print("ready", flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""

# One member: nodus0 up, ICE with the peer (offers crossed over stdin/stdout by the test),
# WireGuard's port rule, the peer on its ICE address; until stdin closes; then its state.
MEMBER = """
import asyncio, json, sys
from libs.wg.uapi import DeviceConfig, PeerConfig
from services.agent.direct.ice import Offer, PairIce
from services.agent.direct.nodus0 import Nodus0
from services.agent.direct.wgport import Mapping, PortMap

async def main(controlling, private, address, peer_key, peer_address, stun_host):
    loop = asyncio.get_running_loop()
    device = Nodus0()
    await device.create(address, 10)
    await device.configure(DeviceConfig(private_key=bytes.fromhex(private), listen_port=51820))
    ice = PairIce(controlling == "1", (stun_host, 3478))
    offer = await ice.offer()
    print(json.dumps([offer.ufrag, offer.pwd, offer.candidates]), flush=True)
    ufrag, pwd, candidates = json.loads(await loop.run_in_executor(None, sys.stdin.readline))
    path = await ice.connect(Offer(ufrag, pwd, tuple(candidates)))
    print(json.dumps({"local": path.local, "remote": path.remote,
                      "kinds": [path.local_kind, path.remote_kind]}), flush=True)
    # The checks' socket answers the peer's checks until the peer has its path too.
    await loop.run_in_executor(None, sys.stdin.readline)
    await ice.close()
    ports = PortMap(51820)
    await ports.set(peer_key, Mapping(path.local, path.remote))
    endpoint = f"{path.remote[0]}:{path.remote[1]}"
    await device.configure(DeviceConfig(peers=(
        PeerConfig(bytes.fromhex(peer_key), (peer_address + "/32",), endpoint, 5),)))
    print("configured", flush=True)
    await loop.run_in_executor(None, sys.stdin.read)
    state = await device.state()
    [peer] = state.peers.values()
    await ports.close()
    await device.close()
    print(json.dumps({"handshake": peer.last_handshake, "endpoint": peer.endpoint}), flush=True)

asyncio.run(main(*sys.argv[1:]))
"""

SINK = """
import hashlib, socket
s = socket.create_server(("100.64.0.2", 7000))
print("ready", flush=True)
s.settimeout(15)
conn, _ = s.accept()
digest, size = hashlib.sha256(), 0
while chunk := conn.recv(1 << 16):
    digest.update(chunk); size += len(chunk)
print(size, digest.hexdigest(), flush=True)
"""

SOURCE = """
import socket
data = bytes.fromhex({block!r}) * 2048
with socket.create_connection(("100.64.0.2", 7000), timeout=15) as s:
    s.sendall(data)
"""


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[NetLab]:
    with running_lab(FLEET, tmp_path / "lab.json", reach_from_host=False) as netlab:
        yield netlab


def _spawn(argv: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO, env=ENV
    )


def _line(process: subprocess.Popen[str]) -> str:
    assert process.stdout is not None
    line = process.stdout.readline()
    assert line, f"process {process.args!r} ended early ({process.poll()})"
    return line.strip()


def test_two_vms_behind_different_nats_join_over_nodus0_through_punched_holes(lab: NetLab) -> None:
    control = str(CONTROL_ADDRESS)
    stun = _spawn(
        in_namespace(lab.topology.control, [sys.executable, "-c", STUN.format(host=control)])
    )
    members: list[subprocess.Popen[str]] = []
    try:
        assert _line(stun) == "ready"
        a_key, b_key = generate_private_key(), generate_private_key()
        sides = (
            ("home-a", "1", a_key, "100.64.0.1", b_key, "100.64.0.2"),
            ("cafe-b", "0", b_key, "100.64.0.2", a_key, "100.64.0.1"),
        )
        for machine, controlling, key, address, peer_key, peer_address in sides:
            argv = [sys.executable, "-c", MEMBER, controlling, key.hex(), address]
            argv += [public_key(peer_key).hex(), peer_address, control]
            members.append(_spawn(lab.machine_argv(machine, argv)))
        offers = [_line(m) for m in members]
        for member, peer_offer in zip(members, reversed(offers), strict=True):
            assert member.stdin is not None
            member.stdin.write(peer_offer + "\n")
            member.stdin.flush()
        paths = [json.loads(_line(m)) for m in members]
        for member in members:  # both have a path: the checks' sockets may close
            assert member.stdin is not None
            member.stdin.write("done\n")
            member.stdin.flush()
        assert [_line(m) for m in members] == ["configured", "configured"]
        routers = {lan.machines[0]: str(lan.uplink) for lan in lab.topology.lans}
        # Each reached the other at the other's NAT: the holes the checks punched.
        assert paths[0]["remote"][0] == routers["cafe-b"]
        assert paths[1]["remote"][0] == routers["home-a"]

        sink = _spawn(lab.machine_argv("cafe-b", [sys.executable, "-c", SINK]))
        try:
            assert _line(sink) == "ready"
            block = secrets.token_bytes(1024)  # 2 MiB in all
            run_python(lab.machine_argv("home-a", []), SOURCE.format(block=block.hex()), timeout=40)
            size, digest = _line(sink).split()
            assert int(size) == len(block) * 2048
            assert digest == hashlib.sha256(block * 2048).hexdigest()
        finally:
            sink.kill()
            sink.wait()
        for member, path in zip(members, paths, strict=True):
            out, _ = member.communicate(timeout=15)
            state = json.loads(out.strip().splitlines()[-1])
            assert state["handshake"] > 0
            # WireGuard still talks to the address ICE chose: its datagrams came from the
            # port the checks opened, so the NAT kept the mapping.
            assert state["endpoint"] == f"{path['remote'][0]}:{path['remote'][1]}"
    finally:
        for process in (stun, *members):
            if process.poll() is None:
                process.kill()
                process.wait()

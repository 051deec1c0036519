"""The agent's Direct member on three lab VMs (one on a public address, two behind their own
providers' NATs): the bus and a real relay (with STUN) run in the lab's control namespace,
each member's `nodus0` finds every peer through ICE offers exchanged in `nodus-ice`, and
bytes cross every pair's mesh addresses intact, in both directions."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import msgspec
import pytest

from app.netlab import CONTROL_ADDRESS, NetLab, in_namespace, missing_requirements
from libs.bus import Bus
from libs.bus.server import NatsServer
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.bounds import derive
from libs.contracts.epochs import Epoch, EpochMember
from libs.contracts.jobs import PathClass
from libs.contracts.relay import RelayRecord
from tests.integration.lab_programs import ENV, REPO, lab_fleet, run_python, running_lab

pytestmark = [
    pytest.mark.slow,
    # Known defect (issue 11): now and then a pair that ICE joined carries nothing over nodus0
    # (seen under the full suite's load and in 2 of 9 lab demos); it runs and reports, and does
    # not fail CI until it is understood.
    pytest.mark.xfail(
        strict=False, reason="a joined Direct pair sometimes carries nothing (issue 11)"
    ),
    pytest.mark.skipif(
        (
            reason := missing_requirements()
            or next(
                (f"no {t}" for t in ("wireguard-go", "conntrack") if shutil.which(t) is None), None
            )
        )
        is not None,
        reason=str(reason),
    ),
]

MACHINES = (
    ("lambda-a", "lambda", "198.18.2.1", False, "100.64.7.1"),
    ("home-b", "home", "198.19.3.1", True, "100.64.7.2"),
    ("cafe-c", "cafe", "198.19.4.1", True, "100.64.7.3"),
)
FLEET = lab_fleet(*((name, provider, address, nat) for name, provider, address, nat, _ in MACHINES))

# One machine's agent, for the Direct path only: its key recorded as the agent records it
# when it redeems its join key, then DirectMember; the paths it found once every peer has one.
MEMBER = """
import asyncio, json, sys
import msgspec
from libs.bus import Bus
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.epochs import Epoch
from libs.contracts.relay import Member
from libs.wg import generate_private_key, key_to_base64, public_key
from services.agent.direct import DirectMember

async def main(url, epoch_json, node, underlay):
    epoch = msgspec.json.decode(epoch_json, type=Epoch)
    me = next(m for m in epoch.members if m.node == node)
    bus = await Bus.open(url, name=node, buckets=[names.BUCKET_MEMBERS, names.BUCKET_ICE, names.BUCKET_RELAYS])
    private = generate_private_key()
    await bus.bucket(names.BUCKET_MEMBERS, Member).put(
        names.member_key(epoch.gang, epoch.epoch, node),
        Member(gang=epoch.gang, epoch=epoch.epoch, node=node, rank=me.rank, address=me.address,
               wg_public_key=key_to_base64(public_key(private)), joined_time=now()))
    member = DirectMember(bus, epoch, me, private, underlay=underlay)
    await member.start()
    peers = len(epoch.members) - 1
    while len(member.paths) + len(member.failures) < peers:
        await asyncio.sleep(0.05)
    print(json.dumps({"paths": {p: [x.remote, x.remote_kind] for p, x in member.paths.items()},
                      "failures": member.failures}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await member.stop()
    await bus.close()

asyncio.run(main(*sys.argv[1:]))
"""

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


def _epoch() -> Epoch:
    members = [
        EpochMember(rank=rank, node=name, address=mesh, interface="nodus0", devices=[], env={})
        for rank, (name, _, _, _, mesh) in enumerate(MACHINES)
    ]
    t = now()
    return Epoch(
        gang="acme.train",
        epoch=1,
        path=PathClass.DIRECT,
        mesh_id=secrets.token_hex(8),
        verify_key="",
        members=members,
        bounds=derive(PathClass.DIRECT, len(members)),
        created_time=t,
        join_keys_expire_time=t + timedelta(minutes=15),
        placed_by="test",
    )


def _relay(lab: NetLab, tmp_path: Path, url: str) -> subprocess.Popen[bytes]:
    mesh_key = tmp_path / "mesh.key"
    mesh_key.write_bytes(os.urandom(32).hex().encode())
    argv = [
        sys.executable,
        "-m",
        "app",
        "relay",
        "--nats",
        url,
        "--name",
        "relay-0",
        "--region",
        "us-east",
        "--listen",
        f"{CONTROL_ADDRESS}:4430",
        "--stun-port",
        "3478",
        "--mesh-key-file",
        str(mesh_key),
        "--usage-journal",
        str(tmp_path / "relay.usage"),
        "--log-format",
        "text",
    ]
    log = open(tmp_path / "relay.log", "wb")
    return subprocess.Popen(
        in_namespace(lab.topology.control, argv),
        cwd=REPO,
        env=ENV,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


async def _wait_for_stun(url: str) -> None:
    bus = await Bus.open(url, name="test", buckets=names.ALL_BUCKETS, streams=True)
    try:
        relays = bus.bucket(names.BUCKET_RELAYS, RelayRecord)
        for _ in range(200):
            if any(r.value.stun_address for r in (await relays.snapshot()).values()):
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the relay never announced its STUN address")
    finally:
        await bus.close()


def test_three_vms_two_behind_nat_join_over_nodus0_and_every_pair_carries_bytes(
    lab: NetLab, tmp_path: Path
) -> None:
    server = NatsServer(
        tmp_path / "nats",
        port=4222,
        host=str(CONTROL_ADDRESS),
        launcher=in_namespace(lab.topology.control, []),
    ).start()
    processes: list[subprocess.Popen[str] | subprocess.Popen[bytes]] = []
    try:
        relay = _relay(lab, tmp_path, server.url)
        processes.append(relay)
        asyncio.run(_wait_for_stun(server.url))
        epoch_json = msgspec.json.encode(_epoch()).decode()
        members = []
        for name, _, address, *_ in MACHINES:
            argv = [sys.executable, "-c", MEMBER, server.url, epoch_json, name, address]
            member = subprocess.Popen(
                lab.machine_argv(name, argv),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                cwd=REPO,
                env=ENV,
            )
            members.append(member)
            processes.append(member)
        reports = {}
        for (name, *_), member in zip(MACHINES, members, strict=True):
            assert member.stdout is not None
            line = member.stdout.readline()
            assert line, f"{name}'s member ended: see {tmp_path}"
            reports[name] = json.loads(line)
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
            processes.append(echo)
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
        for member in members:
            member.communicate(timeout=20)
            assert member.returncode == 0
        relay_log = (tmp_path / "relay.log").read_text()
        assert "Traceback" not in relay_log, relay_log
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        server.stop()

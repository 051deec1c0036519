"""Direct members on lab VMs, as the agent runs them: the bus and a real relay (with STUN) in
the lab's control namespace, one process per machine running `DirectMember` with the
machine's own key recorded as the agent records it, reporting its paths on stdout."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import msgspec

from app.netlab import CONTROL_ADDRESS, NetLab, in_namespace
from libs.bus import Bus
from libs.bus.auth import AGENT, RELAY
from libs.bus.server import NatsServer
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.bounds import derive
from libs.contracts.epochs import Epoch, EpochMember
from libs.contracts.jobs import PathClass
from libs.contracts.relay import RelayRecord
from tests.integration.lab_programs import ENV, REPO

# One machine's Direct member: once every pair's first round ended, one line with the paths
# (peer -> [remote, kind]) and failures; then, each time a line comes on stdin, a line with
# the current path to every peer (direct | derp:<region>); it stops at end of input.
MEMBER = """
import asyncio, json, sys
import msgspec
from libs.bus import Bus
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.epochs import Epoch
from libs.contracts.relay import Member
from libs.wg import generate_private_key, key_to_base64, public_key
from services.agent.direct.member import DirectMember
from libs.bus.auth import AGENT_BUCKETS, agent_inbox

async def main(url, credentials, epoch_json, node, underlay):
    epoch = msgspec.json.decode(epoch_json, type=Epoch)
    me = next(m for m in epoch.members if m.node == node)
    # As the agent does: its own bus user, confined to its node (S1).
    bus = await Bus.open(url, name=node, credentials=credentials, buckets=AGENT_BUCKETS,
                         inbox_prefix=agent_inbox(node), confined=True)
    private = generate_private_key()
    record = Member(gang=epoch.gang, epoch=epoch.epoch, node=node, rank=me.rank,
                    address=me.address, wg_public_key=key_to_base64(public_key(private)),
                    joined_time=now())
    await bus.bucket(names.BUCKET_MEMBERS, Member).put(
        names.member_key(epoch.gang, epoch.epoch, node), record)
    for peer in epoch.members:
        if peer.node != node:
            await bus.bucket(names.BUCKET_PEERS, Member).put(
                names.peer_key(epoch.gang, epoch.epoch, peer.node, node), record)
    member = DirectMember(bus, epoch, me, private, underlay=underlay)
    await member.start()
    peers = [m.node for m in epoch.members if m.node != node]
    for peer in peers:
        await member.first_round(peer)
    print(json.dumps({"paths": {p: [x.remote, x.remote_kind] for p, x in member.paths.items()},
                      "failures": member.failures}), flush=True)
    loop = asyncio.get_running_loop()
    while await loop.run_in_executor(None, sys.stdin.readline):
        print(json.dumps({p: member.path_to(p) for p in peers}), flush=True)
    await member.stop()
    await bus.close()

asyncio.run(main(*sys.argv[1:]))
"""


def epoch_of(machines: list[tuple[str, str]], gang: str = "acme.train", number: int = 1) -> Epoch:
    """A Direct epoch of (machine, mesh address) members."""
    members = [
        EpochMember(rank=rank, node=name, address=mesh, interface="nodus0", devices=[], env={})
        for rank, (name, mesh) in enumerate(machines)
    ]
    t = now()
    return Epoch(
        gang=gang,
        epoch=number,
        path=PathClass.DIRECT,
        mesh_id=secrets.token_hex(8),
        verify_key="",
        members=members,
        bounds=derive(PathClass.DIRECT, len(members)),
        created_time=t,
        join_keys_expire_time=t + timedelta(minutes=15),
        placed_by="test",
    )


def start_relay(
    lab: NetLab, tmp_path: Path, server: NatsServer, index: int = 0, relays: int = 1
) -> subprocess.Popen[bytes]:
    """Relay `index` of `relays`, meshed with the others (ports 4430 + i), with its own bus
    user."""
    others = [f"{CONTROL_ADDRESS}:{4430 + i}" for i in range(relays) if i != index]
    mesh_key = tmp_path / "mesh.key"
    if not mesh_key.exists():
        mesh_key.write_bytes(os.urandom(32).hex().encode())
    argv = [
        sys.executable,
        "-m",
        "app",
        "relay",
        "--nats",
        server.url,
        "--credentials",
        server.user(f"relay-{index}", RELAY, f"relay-{index}"),
        "--name",
        f"relay-{index}",
        "--region",
        "us-east",
        "--listen",
        f"{CONTROL_ADDRESS}:{4430 + index}",
        "--stun-port",
        str(3478 + index),
        *(["--mesh-with", ",".join(others)] if others else []),
        "--mesh-key-file",
        str(mesh_key),
        "--usage-journal",
        str(tmp_path / f"relay-{index}.usage"),
        "--log-format",
        "text",
    ]
    log = open(tmp_path / f"relay-{index}.log", "wb")
    return subprocess.Popen(
        in_namespace(lab.topology.control, argv),
        cwd=REPO,
        env=ENV,
        stdout=log,
        stderr=subprocess.STDOUT,
    )


async def _wait_for_stun(server: NatsServer, relays: int = 1) -> None:
    bus = await Bus.open(
        server.url,
        name="test",
        credentials=server.credentials,
        buckets=names.ALL_BUCKETS,
        streams=True,
    )
    try:
        bucket = bus.bucket(names.BUCKET_RELAYS, RelayRecord)
        for _ in range(200):
            records = (await bucket.snapshot()).values()
            if sum(1 for r in records if r.value.stun_address) >= relays:
                return
            await asyncio.sleep(0.05)
        raise AssertionError("the relay never announced its STUN address")
    finally:
        await bus.close()


def wireguard_env() -> dict[str, str]:
    """The WireGuard choice of the run (NODUS_WIREGUARD, NODUS_WIREGUARD_GO), as an agent's
    flags would pass it to its dataplane."""
    return {k: v for k, v in os.environ.items() if k in ("NODUS_WIREGUARD", "NODUS_WIREGUARD_GO")}


@dataclass
class Members:
    url: str
    processes: dict[str, subprocess.Popen[str]]
    reports: dict[str, dict[str, Any]]  # machine -> its first report (paths, failures)
    logs: Path
    others: list[subprocess.Popen[Any]] = field(default_factory=list)
    # From the members' start (a fresh process each: bus, nodus0, relays) until every pair's
    # first round of checks ended on every member.
    joined_seconds: float = 0.0

    def stop(self, machine: str | None = None) -> None:
        """End the members' input (all, or one): they stop their dataplane and exit 0."""
        for name, process in self.processes.items():
            if machine is None or name == machine:
                process.communicate(timeout=20)
                assert process.returncode == 0, f"{name}: see {self.logs}"

    def kill(self) -> None:
        for process in [*self.processes.values(), *self.others]:
            if process.poll() is None:
                process.kill()
                process.wait()

    def paths(self, machine: str) -> dict[str, str]:
        """`machine`'s current path to each peer."""
        process = self.processes[machine]
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write("\n")
        process.stdin.flush()
        line = process.stdout.readline()
        assert line, f"{machine}'s member ended: see {self.logs}"
        return dict(json.loads(line))


@contextlib.contextmanager
def control_plane(
    lab: NetLab, tmp_path: Path, relays: int = 1
) -> Iterator[tuple[NatsServer, list[subprocess.Popen[Any]]]]:
    """nats-server (authentication on) and meshed relays (with STUN) in the lab's control
    namespace: the bus, and a list whose processes are killed at the end (the relays first,
    by index, and what the caller adds)."""
    server = NatsServer(
        tmp_path / "nats",
        port=4222,
        host=str(CONTROL_ADDRESS),
        launcher=in_namespace(lab.topology.control, []),
    ).start()
    others: list[subprocess.Popen[Any]] = []
    try:
        for index in range(relays):
            others.append(start_relay(lab, tmp_path, server, index, relays))
        asyncio.run(_wait_for_stun(server, relays))
        yield server, others
    finally:
        for process in others:
            if process.poll() is None:
                process.kill()
                process.wait()
        server.stop()


def start_members(
    lab: NetLab, server: NatsServer, epoch: Epoch, addresses: dict[str, str], logs: Path
) -> Members:
    """The epoch's members on their machines (`addresses`: machine -> its address), once
    every pair's first round ended on every one; each with its agent's bus user."""
    url = server.url
    members = Members(url, {}, {}, logs)
    epoch_json = msgspec.json.encode(epoch).decode()
    began = time.monotonic()
    try:
        for planned in epoch.members:
            name = planned.node
            credentials = server.user(f"agent-{name}", AGENT, name)
            argv = [sys.executable, "-c", MEMBER, url, credentials, epoch_json, name]
            argv.append(addresses[name])
            members.processes[name] = subprocess.Popen(
                lab.machine_argv(name, argv),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=open(logs / f"{name}.{epoch.gang}.{epoch.epoch}.log", "w"),
                text=True,
                cwd=REPO,
                env={**ENV, **wireguard_env()},
            )
        for name, process in members.processes.items():
            assert process.stdout is not None
            line = process.stdout.readline()
            assert line, f"{name}'s member ended: see {logs}"
            members.reports[name] = json.loads(line)
    except BaseException:
        members.kill()
        raise
    members.joined_seconds = time.monotonic() - began
    return members


@contextlib.contextmanager
def direct_members(
    lab: NetLab, tmp_path: Path, machines: list[tuple[str, str, str]], relays: int = 1
) -> Iterator[Members]:
    """(machine, its address, its mesh address) as members of one Direct epoch, every pair's
    first round done; stopped afterwards. `members.others[:relays]` are the relays."""
    with control_plane(lab, tmp_path, relays) as (server, others):
        epoch = epoch_of([(n, mesh) for n, _, mesh in machines])
        members = start_members(lab, server, epoch, {n: a for n, a, _ in machines}, tmp_path)
        others.extend(members.processes.values())
        members.others = others
        yield members
        members.stop()

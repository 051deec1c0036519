"""The relay's STUN: a member behind the lab's NAT learns its router's public address as its
server-reflexive ICE candidate (aioice gathering against the relay's server); datagrams that
are not Binding requests are ignored and the server keeps answering."""

from __future__ import annotations

import asyncio
import json
import secrets
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from aioice import stun

from app.netlab import CONTROL_ADDRESS, NetLab, in_namespace, missing_requirements
from services.relay.stun import StunServer
from tests.integration.lab_programs import REPO, lab_fleet, run_python, running_lab

SERVE = """
import asyncio
from services.relay.stun import StunServer

async def main():
    server = StunServer("{host}", 3478)
    await server.start()
    print("ready", flush=True)
    await asyncio.sleep(30)

asyncio.run(main())
"""

GATHER = """
import asyncio, json
import aioice

async def main():
    connection = aioice.Connection(ice_controlling=True, stun_server=("{host}", 3478), use_ipv6=False)
    await connection.gather_candidates()
    print(json.dumps([[c.type, c.host] for c in connection.local_candidates]))
    await connection.close()

asyncio.run(main())
"""


async def test_datagrams_that_are_not_binding_requests_are_ignored_and_answering_goes_on() -> None:
    server = StunServer("127.0.0.1", 0)
    await server.start()
    loop = asyncio.get_running_loop()
    client = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    client.setblocking(False)
    client.bind(("127.0.0.1", 0))
    try:
        for junk in (
            b"",
            b"\x00" * 7,
            secrets.token_bytes(64),
            bytes(stun.Message(stun.Method.ALLOCATE, stun.Class.REQUEST)),
        ):
            client.sendto(junk, ("127.0.0.1", server.port))
        request = stun.Message(stun.Method.BINDING, stun.Class.REQUEST)
        client.sendto(bytes(request), ("127.0.0.1", server.port))
        data = await asyncio.wait_for(loop.sock_recv(client, 2048), 2)
        response = stun.parse_message(data)
        assert response.transaction_id == request.transaction_id  # the first answer is to it
        assert response.message_class == stun.Class.RESPONSE
        assert response.attributes["XOR-MAPPED-ADDRESS"] == client.getsockname()
    finally:
        client.close()
        await server.stop()


FLEET = lab_fleet(("home-a", "home", "198.19.3.1", True))


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[NetLab]:
    reason = missing_requirements()
    if reason is not None:
        pytest.skip(reason)
    with running_lab(FLEET, tmp_path / "lab.json", reach_from_host=False) as netlab:
        yield netlab


def test_a_member_behind_nat_learns_its_routers_public_address(lab: NetLab) -> None:
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    host = str(CONTROL_ADDRESS)
    server = subprocess.Popen(
        in_namespace(lab.topology.control, [sys.executable, "-c", SERVE.format(host=host)]),
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        cwd=REPO,
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        gathered = run_python(
            lab.machine_argv("home-a", ["env", f"PYTHONPATH={REPO}"]), GATHER.format(host=host)
        )
    finally:
        server.kill()
        server.wait()
    candidates = {(kind, address) for kind, address in json.loads(gathered)}
    [router] = lab.topology.lans
    assert ("host", "198.19.3.1") in candidates
    assert ("srflx", str(router.uplink)) in candidates

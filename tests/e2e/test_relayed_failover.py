"""Done-when of the Relayed path, with real processes: 512 MiB each way between the two members
of a Relayed gang through the relays; the relay carrying the traffic is killed (SIGKILL) in
the middle; every byte arrives intact and in order, on a connection that was never reset, and
is billed once. The same holds when the relay comes back and its members move home to it, and
when both of the gang's relays are lost for good and the members move to a third."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import random
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import yaml

from app.local import LocalSystem
from libs.bus.server import free_port
from libs.client.client import Client
from libs.contracts import names
from libs.contracts.jobs import Phase
from libs.contracts.lifecycle import JoinedEpochsReply, JoinedEpochsRequest
from tests.e2e.relayed_lab import billed, settled_bills
from tests.factories import job
from tests.socks_client import socks_connect

pytestmark = pytest.mark.slow

SIZE = 512 << 20
BLOCK = 1 << 20
BLOCKS = [random.Random(seed).randbytes(BLOCK) for seed in range(16)]


def block(index: int) -> bytes:
    return BLOCKS[(index * 7 + 3) % len(BLOCKS)]


def expected_digest() -> str:
    digest = hashlib.sha256()
    for index in range(SIZE // BLOCK):
        digest.update(block(index))
    return digest.hexdigest()


FLEET = {
    "machines": [
        {
            "name": "vast-a",
            "provider": "vast",
            "region": "eu-central-1",
            "regionClass": "eu",
            "offering": "container",
            "address": "127.0.1.31",
            "pool": "l4",
            "cluster": "eu",
            "accelerators": {"count": 1, "backend": "cuda", "model": "L4"},
        },
        {
            "name": "lam-b",
            "provider": "lambda",
            "region": "eu-central-1",
            "regionClass": "eu",
            "offering": "vm",
            "address": "127.0.1.32",
            "pool": "l4",
            "cluster": "eu",
            "accelerators": {"count": 1, "backend": "cuda", "model": "L4"},
        },
    ]
}


@contextlib.asynccontextmanager
async def stalled_after(seconds: float, what: str) -> AsyncIterator[None]:
    """Fail, saying so, if the stream inside has not finished in `seconds`."""
    try:
        async with asyncio.timeout(seconds):
            yield
    except TimeoutError:
        pytest.fail(f"the stream stalled for {seconds:g} s after {what}")


async def joined(client: Client, node: str) -> JoinedEpochsReply:
    return await client.bus.request(
        names.node_request(node, names.AgentVerb.EPOCHS), JoinedEpochsRequest(), JoinedEpochsReply
    )


async def running_gang(tmp_path: Path, name: str, relays: int = 2) -> tuple[LocalSystem, Client]:
    """The system up (with `relays` meshed relays) and a Relayed gang of vast-a and lam-b
    Running (its probe done: the probe's bytes come before the test's)."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump(FLEET))
    system = LocalSystem(
        fleet_path=fleet,
        state_dir=tmp_path / "state",
        nats_port=free_port(),
        heartbeat_seconds=1.0,
        relays=relays,
    )
    await system.start()
    client = await Client.connect(system.url)
    try:
        await client.apply(
            job(
                name,
                org="acme",
                command=["sleep", "600"],  # outlives the test: the gang stays up while we stream
                accelerators={"model": "L4"},
                distributed={"members": 2, "transport": "Auto"},
            )
        )
        for _ in range(600):
            placed = await client.get_job(name)
            if placed.status.phase not in (Phase.PENDING, Phase.PLACED, Phase.PROBING):
                break
            await asyncio.sleep(0.1)
        assert placed.status.phase is Phase.RUNNING, placed.status
    except BaseException:
        await client.close()
        system.stop()
        raise
    return system, client


async def test_512_mib_each_way_survive_the_relay_carrying_them_being_killed(
    tmp_path: Path,
) -> None:
    system, client = await running_gang(tmp_path, "big")
    try:
        # The probe's last bytes may still be in the tunnel as it reports: billed before ours.
        billed_before = await settled_bills(client)
        records = {r.inventory.node: r for r, _, _ in await client.list_nodes()}
        socks = records["vast-a"].socks_endpoint.rsplit(":", 1)

        received = hashlib.sha256()
        count = [0]
        server_sent = asyncio.Event()
        b_done = asyncio.Event()

        async def member_b(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            async def send_back() -> None:
                for index in range(SIZE // BLOCK):
                    writer.write(block(index))
                    await writer.drain()
                writer.write_eof()
                server_sent.set()

            sender = asyncio.create_task(send_back())
            while data := await reader.read(1 << 18):
                received.update(data)
                count[0] += len(data)
            await sender
            writer.close()
            b_done.set()

        server = await asyncio.start_server(member_b, "127.0.1.32", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            code, reader, writer = await socks_connect(
                (socks[0], int(socks[1])), "127.0.1.32", port
            )
            assert code == 0
            home = (await joined(client, "vast-a")).epochs[0].relay
            carrying = next(c for c in system.children if c.name == home)
            back = hashlib.sha256()
            back_count = [0]

            async def read_back() -> None:
                while data := await reader.read(1 << 18):
                    back.update(data)
                    back_count[0] += len(data)

            reading = asyncio.create_task(read_back())
            for index in range(SIZE // BLOCK):
                writer.write(block(index))
                await writer.drain()
                if index == SIZE // BLOCK // 2:
                    os.kill(carrying.process.pid, signal.SIGKILL)  # mid-stream
            writer.write_eof()
            await asyncio.wait_for(reading, 300)
            await asyncio.wait_for(server_sent.wait(), 60)
            await asyncio.wait_for(b_done.wait(), 60)  # member B read everything A sent
            writer.close()
        digest = expected_digest()
        assert count[0] == SIZE and received.hexdigest() == digest
        assert back_count[0] == SIZE and back.hexdigest() == digest
        moved = (await joined(client, "vast-a")).epochs[0].relay
        assert moved is not None and moved != home
        # Billed once (G17): what the dead relay metered and the members then resent through
        # the other one is not billed twice. The killed relay publishes its journal once back.
        system.restart(carrying.name)
        # Each member's program sent SIZE, plus the link's own headers (well under 0.1 %).
        # The bill is late at worst: the relays' counts (resends included) come first, the
        # member's own total with its relay's next flush, and the bill settles on it.
        for _ in range(100):
            bills = {
                node: b - billed_before.get(node, 0) for node, b in (await billed(client)).items()
            }
            if all(SIZE <= bills.get(node, 0) <= SIZE * 1.001 for node in ("vast-a", "lam-b")):
                break
            await asyncio.sleep(0.2)
        for node in ("vast-a", "lam-b"):
            assert SIZE <= bills[node] <= SIZE * 1.001, (node, bills[node] / SIZE)
    finally:
        await client.close()
        system.stop()


class OneWay:
    """A stream from a program on vast-a, through its SOCKS5 entry and the relays, to a server
    on lam-b: what was sent and what arrived, hashed."""

    def __init__(self) -> None:
        self.sent, self.sent_count, self.blocks = hashlib.sha256(), 0, 0
        self.received, self.received_count = hashlib.sha256(), 0
        self.done = asyncio.Event()
        self.writer: asyncio.StreamWriter | None = None

    async def _receive(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1 << 18):
            self.received.update(data)
            self.received_count += len(data)
        writer.close()
        self.done.set()

    @contextlib.asynccontextmanager
    async def open(self, client: Client) -> AsyncIterator[None]:
        records = {r.inventory.node: r for r, _, _ in await client.list_nodes()}
        host, _, socks_port = records["vast-a"].socks_endpoint.rpartition(":")
        server = await asyncio.start_server(self._receive, "127.0.1.32", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            code, _, self.writer = await socks_connect((host, int(socks_port)), "127.0.1.32", port)
            assert code == 0
            yield

    async def send(self) -> None:
        assert self.writer is not None
        data = block(self.blocks)
        self.writer.write(data)
        await self.writer.drain()  # waits while the member has no relay
        self.sent.update(data)
        self.sent_count += len(data)
        self.blocks += 1

    async def sending(self, seconds: float) -> AsyncIterator[int]:
        """Send block after block for at most `seconds`, yielding how many are sent so far;
        the caller stops it when what it waits for under the stream happened."""
        deadline = asyncio.get_running_loop().time() + seconds
        while asyncio.get_running_loop().time() < deadline:
            await self.send()
            yield self.blocks

    async def finish(self) -> None:
        """Close the sending side and wait for the server to have read everything."""
        assert self.writer is not None
        self.writer.write_eof()
        await asyncio.wait_for(self.done.wait(), 120)
        self.writer.close()

    def arrived_whole(self) -> bool:
        return (self.received_count, self.received.hexdigest()) == (
            self.sent_count,
            self.sent.hexdigest(),
        )


async def assert_billed_once(client: Client, before: dict[str, int], sent: int) -> None:
    """vast-a is billed what its program sent, within 0.1 % (the link's own headers): the
    resends of a move are not the user's. The bill is late at worst, so it is awaited."""
    for _ in range(100):
        bill = (await billed(client)).get("vast-a", 0) - before.get("vast-a", 0)
        if sent <= bill <= sent * 1.001:
            return
        await asyncio.sleep(0.2)
    assert sent <= bill <= sent * 1.001, bill / sent


async def test_a_member_moves_home_under_a_stream_once_its_relay_is_back(tmp_path: Path) -> None:
    """A relay restarted (an upgrade, a crash): its members failed over to the other relay,
    and once it is back and stays up they move home to it, so the placer's spread of gangs
    over the relays holds. The stream carried through both moves arrives whole, in order, on
    one connection, and is billed once."""
    system, client = await running_gang(tmp_path, "back")
    try:
        billed_before = await settled_bills(client)
        stream = OneWay()
        async with stream.open(client):
            home = (await joined(client, "vast-a")).epochs[0].relay
            assert home is not None
            carrying = next(c for c in system.children if c.name == home)
            moves: list[str | None] = []
            async for index in stream.sending(90):
                if index == 64:
                    os.kill(carrying.process.pid, signal.SIGKILL)
                    system.restart(carrying.name)  # back at once, as its supervisor would
                elif index > 64 and index % 16 == 0:
                    now_home = (await joined(client, "vast-a")).epochs[0].relay
                    if not moves or moves[-1] != now_home:
                        moves.append(now_home)
                    if now_home == home and len(moves) > 1:
                        break  # moved away, then home again, all under the stream
            returned = moves[-1] == home and len(moves) > 1
            for _ in range(32):  # and the stream goes on from there
                await stream.send()
            await stream.finish()
        assert returned, f"vast-a's homes after {home} was restarted: {moves}"
        assert stream.arrived_whole()
        await assert_billed_once(client, billed_before, stream.sent_count)
    finally:
        await client.close()
        system.stop()


async def test_members_whose_two_relays_are_lost_move_to_a_third_under_a_stream(
    tmp_path: Path,
) -> None:
    """Both of a gang's relays lost for good (the host that ran them, say): once neither has
    been up for longer than a restart takes, each member is given the third relay, which
    meshes with every other. The stream carried through arrives whole, in order, on one
    connection, and is billed once. Before, the members waited for their relays forever."""
    system, client = await running_gang(tmp_path, "rescued", relays=3)
    try:
        gang = (await client.get_job("rescued")).status.gang
        assert gang is not None and len(gang.relays) == 2
        (third,) = {f"relay-{i}" for i in range(3)} - set(gang.relays)
        billed_before = await settled_bills(client)
        stream = OneWay()
        homes: dict[str, str | None] = {}
        async with stream.open(client), stalled_after(60, "both of the gang's relays were lost"):
            async for index in stream.sending(90):
                if index == 64:
                    for lost in gang.relays:  # for good: no supervisor starts them again
                        child = next(c for c in system.children if c.name == lost)
                        os.kill(child.process.pid, signal.SIGKILL)
                elif index > 64 and index % 16 == 0:
                    for node in ("vast-a", "lam-b"):
                        homes[node] = (await joined(client, node)).epochs[0].relay
                    if set(homes.values()) == {third}:
                        break
            for _ in range(32):  # and the stream goes on from there
                await stream.send()
            await stream.finish()
        assert set(homes.values()) == {third}, (homes, gang.relays, third)
        assert stream.arrived_whole()
        for lost in gang.relays:  # back, they publish what they metered before dying
            system.restart(lost)
        await assert_billed_once(client, billed_before, stream.sent_count)
    finally:
        await client.close()
        system.stop()

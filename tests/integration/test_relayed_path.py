"""The Relayed path end to end in one process: placer, two meshed relays, two agents. A program
on one member reaches a listener on the other member's address through the agent's SOCKS5
entry; refusals come back as SOCKS codes; a relay dies mid-stream and nothing breaks."""

from __future__ import annotations

import asyncio
import hashlib
import os
import random

import pytest

from libs.bus.server import free_port
from tests.conftest import eventually
from tests.integration.conftest import Gang, metric
from tests.socks_client import socks_connect

WG_DROPS = "nodus_agent_wireguard_drops_total"


async def echo_through(gang: Gang, data: bytes = b"still here") -> None:
    """A fresh connection from member A's SOCKS entry to a listener on member B carries bytes
    both ways."""

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write((await reader.read(1 << 16)).upper())
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, gang.addresses[1], 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        code, reader, writer = await socks_connect(gang.socks[0], gang.addresses[1], port)
        assert code == 0
        writer.write(data)
        assert await asyncio.wait_for(reader.read(100), 10) == data.upper()
        writer.close()


async def test_a_program_on_one_member_reaches_a_listener_on_the_other(gang: Gang) -> None:
    received: list[bytes] = []

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        data = await reader.read(1 << 16)
        received.append(data)
        writer.write(data.upper())
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, gang.addresses[1], 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        code, reader, writer = await socks_connect(gang.socks[0], gang.addresses[1], port)
        assert code == 0
        writer.write(b"hello through the relays")
        assert await asyncio.wait_for(reader.read(100), 10) == b"HELLO THROUGH THE RELAYS"
        writer.close()
    assert received == [b"hello through the relays"]
    # And in the other direction, to a listener on member A (the torchrun store, NCCL).
    server = await asyncio.start_server(echo, gang.addresses[0], 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        code, reader, writer = await socks_connect(gang.socks[1], gang.addresses[0], port)
        assert code == 0
        writer.write(b"back")
        assert await asyncio.wait_for(reader.read(100), 10) == b"BACK"
        writer.close()


async def test_refusals_come_back_as_socks_codes(gang: Gang) -> None:
    closed_port = free_port(gang.addresses[1])
    code, _, writer = await socks_connect(gang.socks[0], gang.addresses[1], closed_port)
    assert code == 5  # connection refused: the shim turns it into ECONNREFUSED
    writer.close()
    code, _, writer = await socks_connect(gang.socks[0], "127.0.0.99", 80)
    assert code == 2  # not a member of this gang: not allowed
    writer.close()


async def test_a_relay_dying_mid_stream_breaks_nothing(gang: Gang) -> None:
    size = 24 << 20
    pattern = random.Random(5).randbytes(1 << 20)
    digest = hashlib.sha256()
    for _ in range(size >> 20):
        digest.update(pattern)
    got = hashlib.sha256()
    done = asyncio.Event()
    count = [0]

    async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1 << 16):
            got.update(data)
            count[0] += len(data)
        writer.write(b"ok")
        await writer.drain()
        writer.close()
        done.set()

    server = await asyncio.start_server(sink, gang.addresses[1], 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        code, reader, writer = await socks_connect(gang.socks[0], gang.addresses[1], port)
        assert code == 0
        home = gang.agents[0].relayed and next(iter(gang.agents[0].relayed.values())).tunnel
        assert home and home.home is not None
        carrying = next(r for r in gang.relays if r.name == home.home.name)
        killed = False
        for index in range(size >> 20):
            writer.write(pattern)
            await writer.drain()
            if index == (size >> 21) and not killed:
                await carrying.stop()  # the relay carrying the traffic dies
                killed = True
        writer.write_eof()
        await asyncio.wait_for(done.wait(), 60)
        assert await reader.read(10) == b"ok"
        writer.close()
    assert count[0] == size
    assert got.hexdigest() == digest.hexdigest()
    assert home.home is not None and home.home.name != carrying.name


class Recording:
    """Everything the relays read from or write to their sockets."""

    def __init__(self) -> None:
        self.data = bytearray()


@pytest.fixture
def relay_io(monkeypatch: pytest.MonkeyPatch) -> Recording:
    from libs.relayproto import connection as connection_module
    from services.relay import mesh as mesh_module
    from services.relay import relay as relay_module

    recording = Recording()
    base = connection_module.Connection

    class RecordingConnection(base):  # type: ignore[misc, valid-type]
        def data_received(self, data):  # type: ignore[no-untyped-def]
            recording.data += data
            base.data_received(self, data)

        def send_all(self, encoded):  # type: ignore[no-untyped-def]
            recording.data += b"".join(encoded)
            return base.send_all(self, encoded)

    monkeypatch.setattr(relay_module, "Connection", RecordingConnection)
    monkeypatch.setattr(mesh_module, "Connection", RecordingConnection)
    return recording


async def test_relays_see_only_ciphertext(relay_io: Recording, gang: Gang) -> None:
    pattern = b"NODUS-PLAINTEXT-PATTERN-0123456789" * 2000
    got = bytearray()

    async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1 << 16):
            got.extend(data)
        writer.close()

    server = await asyncio.start_server(sink, gang.addresses[1], 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        code, _, writer = await socks_connect(gang.socks[0], gang.addresses[1], port)
        assert code == 0
        for _ in range(8):
            writer.write(pattern)
        await writer.drain()
        writer.write_eof()

        async def delivered() -> bool:
            return len(got) == 8 * len(pattern)

        await eventually(delivered)
        writer.close()
    assert bytes(got) == pattern * 8
    assert len(relay_io.data) > len(pattern) * 8  # the relays did carry it ...
    assert b"NODUS-PLAINTEXT" not in relay_io.data  # ... and never saw it (G16)


async def test_forged_wireguard_messages_are_dropped_and_counted(gang: Gang) -> None:
    """Each kind of forgery a relay would carry (it sees ciphertext only) is dropped by the
    receiving member under its own reason, and the gang goes on."""
    runtime_a = next(iter(gang.agents[0].relayed.values()))
    runtime_b = next(iter(gang.agents[1].relayed.values()))
    tunnel_a, tunnel_b = runtime_a.tunnel, runtime_b.tunnel
    assert tunnel_a is not None and tunnel_b is not None
    home = tunnel_a.home
    assert home is not None
    await echo_through(gang)  # a session between A and B is up
    session = tunnel_b.device._device.peers[tunnel_a.device.public_key].current
    assert session is not None
    real_index = session.local_index.to_bytes(4, "little")
    forgeries = {
        # A transport message for a receiver index B never handed out.
        "unknown receiver index": b"\x04\x00\x00\x00"
        + (session.local_index ^ 0x5A5A5A5A).to_bytes(4, "little")
        + os.urandom(8 + 64 + 16),
        # One for B's live session, with a counter and ciphertext nobody encrypted.
        "transport authentication failed": b"\x04\x00\x00\x00"
        + real_index
        + os.urandom(8 + 64 + 16),
        # An initiation of the right size that no key made.
        "bad mac1": b"\x01\x00\x00\x00" + os.urandom(148 - 4),
    }
    for reason, forged in forgeries.items():
        before = {r: metric(WG_DROPS, reason=r) for r in forgeries}
        home.send_now(tunnel_b.device.public_key, forged)

        async def counted(reason: str = reason, before: dict[str, float] = before) -> bool:
            return metric(WG_DROPS, reason=reason) == before[reason] + 1

        await eventually(counted)
        others = {r: metric(WG_DROPS, reason=r) for r in forgeries if r != reason}
        assert others == {r: v for r, v in before.items() if r != reason}
    await echo_through(gang)


async def test_a_replayed_hello_is_refused(gang: Gang) -> None:
    from libs.relayproto import Challenge, FrameDecoder, Hello, encode, member_proof
    from libs.relayproto.frames import ErrorFrame

    runtime = next(iter(gang.agents[0].relayed.values()))
    assert runtime.tunnel is not None
    device = runtime.tunnel.device
    relay = gang.relays[0]
    # A proof made for one challenge ...
    reader, writer = await asyncio.open_connection(*relay.listen)
    decoder = FrameDecoder()
    challenge = decoder.feed(await reader.read(200))[0]
    assert isinstance(challenge, Challenge)
    proof = member_proof(
        device.private_key, challenge.relay_key, challenge.nonce, "acme.rl", 1, "vast-a"
    )
    writer.close()
    # ... replayed against the next challenge is refused.
    reader, writer = await asyncio.open_connection(*relay.listen)
    decoder = FrameDecoder()
    decoder.feed(await reader.read(200))
    writer.write(encode(Hello("acme.rl", 1, "vast-a", device.public_key, proof)))
    frames = decoder.feed(await asyncio.wait_for(reader.read(500), 5))
    assert isinstance(frames[0], ErrorFrame) and frames[0].code == "BadProof"
    writer.close()


async def test_garbage_thrown_at_relays_and_socks_is_survived(gang: Gang) -> None:
    """Random bytes at the relays' and the agents' listeners: each such connection is counted
    as malformed and dropped; the relays keep serving the gang's sessions, the agents keep
    their tunnels, and a fresh connection through the gang works."""
    rng = random.Random(11)
    targets = [r.listen for r in gang.relays] + list(gang.socks)
    sessions = [set(r.sessions) for r in gang.relays]
    homes = [next(iter(a.relayed.values())).tunnel for a in gang.agents]
    relay_malformed = metric("nodus_relay_frames_dropped_total", reason="malformed")
    socks_malformed = [
        metric("nodus_agent_socks_requests_total", node=a.node, outcome="malformed")
        for a in gang.agents
    ]
    for _ in range(40):
        host, port = rng.choice(targets)
        reader, writer = await asyncio.open_connection(host, port)
        # Never a SOCKS5 greeting (version 5) nor a frame the relay could wait on.
        writer.write(b"\xff" + rng.randbytes(rng.randint(4, 400)))
        try:
            await writer.drain()
            await asyncio.wait_for(reader.read(1000), 1.0)
        except (TimeoutError, ConnectionError):
            pass
        writer.close()

    async def all_counted() -> bool:
        return metric("nodus_relay_frames_dropped_total", reason="malformed") > relay_malformed

    await eventually(all_counted)
    for agent, before in zip(gang.agents, socks_malformed, strict=True):
        after = metric("nodus_agent_socks_requests_total", node=agent.node, outcome="malformed")
        assert after > before
    for relay, before_sessions in zip(gang.relays, sessions, strict=True):
        assert relay.server is not None and relay.server.is_serving()
        assert all(not task.done() for task in relay._tasks)
        assert set(relay.sessions) == before_sessions
    for agent, tunnel in zip(gang.agents, homes, strict=True):
        assert tunnel is not None and tunnel.home is not None
        assert next(iter(agent.relayed.values())).tunnel is tunnel
    await echo_through(gang)

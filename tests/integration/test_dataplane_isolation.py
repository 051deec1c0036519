"""S4 on the Relayed path, in one process: a failure stays where it belongs. A local socket
that dies with data arriving resets its own stream and nothing else; a destination that is
gone costs its sender nothing; a relay that crashes (every connection dropped at once, nothing
flushed) under streams of every shape breaks none of them; a peer that is gone is reported
unreachable at once."""

from __future__ import annotations

import asyncio
import hashlib
import random
import time

from prometheus_client import REGISTRY

from libs.bus import Bus
from libs.runtime.tasks import cancel_and_wait
from services.agent.relayed.tunnel import Tunnel
from services.relay.relay import Relay
from tests.conftest import eventually
from tests.integration.conftest import Gang, Node, connected, enrol, known, metric, wg_shaped
from tests.socks_client import socks_connect


def tunnel_of(gang: Gang, index: int) -> Tunnel:
    runtime = next(iter(gang.agents[index].relayed.values()))
    assert runtime.tunnel is not None
    return runtime.tunnel


def total(family: str) -> float:
    """Every sample of a counter family, whatever its labels."""
    return sum(
        s.value
        for m in REGISTRY.collect()
        if m.name == family
        for s in m.samples
        if s.name.endswith("_total")
    )


async def crash(relay: Relay) -> None:
    """What SIGKILL does to a relay, in process: every connection dropped at once, no usage
    flushed, no goodbye to the mesh."""
    if relay.server is not None:
        relay.server.close()
    for session in list(relay.sessions.values()):
        session.conn.abort()
    for peer in relay.mesh.peers.values():
        if peer.conn is not None:
            peer.conn.abort()
    await cancel_and_wait([*relay._tasks, *relay._handlers])
    relay.meter.counts.clear()  # a killed process forgets what it had not flushed


async def echo_works(gang: Gang, port: int) -> None:
    code, reader, writer = await socks_connect(gang.socks[0], gang.addresses[1], port)
    assert code == 0
    writer.write(b"ping")
    assert await asyncio.wait_for(reader.readexactly(4), 5) == b"PING"
    writer.close()


async def start_echo(address: str) -> asyncio.Server:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1 << 16):
            writer.write(data.upper())
            await writer.drain()
        writer.close()

    return await asyncio.start_server(echo, address, 0)


async def test_a_socket_that_dies_with_data_arriving_resets_only_its_own_stream(
    gang: Gang,
) -> None:
    """Issue 9 (1): the write to a just-closed socket used to escape, drop the relay
    connection, and be resent forever on the next one (a poison message)."""
    chunk = b"z" * (1 << 16)

    async def firehose(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                writer.write(chunk)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    hose = await asyncio.start_server(firehose, gang.addresses[1], 0)
    echo = await start_echo(gang.addresses[1])
    hose_port = hose.sockets[0].getsockname()[1]
    echo_port = echo.sockets[0].getsockname()[1]
    tunnel = tunnel_of(gang, 0)
    failovers = metric("nodus_agent_relay_failovers_total", node="vast-a")
    async with hose, echo:
        # A long-lived request/response stream beside the ones that die.
        code, long_reader, long_writer = await socks_connect(
            gang.socks[0], gang.addresses[1], echo_port
        )
        assert code == 0
        for _ in range(5):
            code, reader, writer = await socks_connect(gang.socks[0], gang.addresses[1], hose_port)
            assert code == 0
            await reader.readexactly(1 << 18)  # data is streaming in
            writer.transport.abort()  # the program dies (a reset, data in flight both ways)
            long_writer.write(b"still here")
            assert await asyncio.wait_for(long_reader.readexactly(10), 5) == b"STILL HERE"
        await echo_works(gang, echo_port)  # new connections too
        long_writer.close()

        async def all_closed() -> bool:
            return not tunnel.bridges and not tunnel_of(gang, 1).bridges

        await eventually(all_closed)
    assert metric("nodus_agent_relay_failovers_total", node="vast-a") == failovers
    resets = sum(
        metric("nodus_agent_stream_resets_total", node="vast-a", reason=reason)
        for reason in ("local_reset", "local_closed", "local_write_failed")
    )
    assert resets >= 1
    assert tunnel.home is not None and tunnel.home.up


async def test_a_destination_that_is_gone_costs_its_sender_nothing(
    bus: Bus, relays: tuple[Relay, Relay]
) -> None:
    """Issue 9 (2): the relay's write to a member whose connection had just closed raised out
    of the *sender's* session and ended it."""
    a, b, c = (Node("acme.trio", 1, n) for n in "abc")
    await enrol(bus, "acme.trio", 1, [a, b, c])
    await known(relays, a, b, c)
    client_a = await connected(a, relays[0])
    await connected(b, relays[0])
    await connected(c, relays[0])
    relay = relays[0]
    # b's connection closes under the relay while its session is still registered: exactly
    # the moment the old relay raised in. Routing to it must drop, count, and not raise.
    before = metric("nodus_relay_frames_dropped_total", reason="destination_closed")
    relay.sessions[b.public].conn.abort()
    assert relay._route(a.public, b.public, wg_shaped(1000)) is None
    relay._write_out()
    assert metric("nodus_relay_frames_dropped_total", reason="destination_closed") == before + 1
    for index in range(200):
        client_a.send_now(b.public, wg_shaped(1000))
        client_a.send_now(c.public, wg_shaped(1000, index % 200))
    for index in range(200):
        src, message = await asyncio.wait_for(c.inbox.get(), 5)
        assert src == a.public and message == wg_shaped(1000, index % 200)
    assert client_a.up and a.public in relay.sessions


async def test_a_member_that_stops_reading_loses_only_its_own_frames(
    bus: Bus, relays: tuple[Relay, Relay]
) -> None:
    """A relay never waits for a destination: past its queue bound, what a member that stopped
    reading cannot take is dropped and counted, and its peers' traffic to others flows on."""
    a, b, c = (Node("acme.stall", 1, n) for n in "abc")
    await enrol(bus, "acme.stall", 1, [a, b, c])
    await known(relays, a, b, c)
    client_a = await connected(a, relays[0])
    stalled = b.client(relays[0])
    await stalled.connect()  # connected, and nobody ever reads it
    await connected(c, relays[0])
    message = wg_shaped(60_000)
    for index in range(1200):  # 72 MB for b, more than the relay queues for one member
        client_a.send_now(b.public, message)
        if index % 10 == 0:
            client_a.send_now(c.public, wg_shaped(100, index % 200))
            await client_a.drain()
    for index in range(0, 1200, 10):
        src, got = await asyncio.wait_for(c.inbox.get(), 10)
        assert src == a.public and got == wg_shaped(100, index % 200)

    async def dropped() -> bool:
        return (
            metric(
                "nodus_relay_destination_drops_total",
                gang="acme.stall",
                member="b",
                reason="destination_full",
            )
            > 0
        )

    await eventually(dropped)
    assert client_a.up and a.public in relays[0].sessions
    stalled.close()


async def test_presence_tells_members_which_peers_a_relay_can_reach(
    bus: Bus, relays: tuple[Relay, Relay]
) -> None:
    a, b = Node("acme.pr", 1, "a"), Node("acme.pr", 1, "b")
    await enrol(bus, "acme.pr", 1, [a, b])
    await known(relays, a, b)
    client_a = await connected(a, relays[0])
    client_b = await connected(b, relays[1])  # reachable from relay 0 through the mesh

    async def a_sees_b() -> bool:
        return b.public in client_a.present

    await eventually(a_sees_b)
    client_b.close()

    async def a_sees_b_gone() -> bool:
        return b.public not in client_a.present

    await eventually(a_sees_b_gone)


async def test_every_kind_of_stream_survives_the_relay_carrying_it_crashing(gang: Gang) -> None:
    """Issue 9 (4): bulk, idle, request/response and half-closed streams at once, the home
    relay crashed under them: every byte arrives, no stream resets."""
    size = 32 << 20
    pattern = random.Random(7).randbytes(1 << 20)
    expected = hashlib.sha256(pattern * (size >> 20)).hexdigest()
    results: dict[str, str] = {}

    async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        digest = hashlib.sha256()
        while data := await reader.read(1 << 16):
            digest.update(data)
        writer.write(digest.hexdigest().encode())  # after our EOF: a half-closed stream
        await writer.drain()
        writer.close()

    async def source(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(size >> 20):
            writer.write(pattern)
            await writer.drain()
        writer.close()

    sink_server = await asyncio.start_server(sink, gang.addresses[1], 0)
    source_server = await asyncio.start_server(source, gang.addresses[1], 0)
    echo = await start_echo(gang.addresses[1])
    ports = [s.sockets[0].getsockname()[1] for s in (sink_server, source_server, echo)]
    tunnel = tunnel_of(gang, 0)
    assert tunnel.home is not None
    carrying = next(r for r in gang.relays if r.name == tunnel.home.name)
    resets_before = total("nodus_agent_stream_resets")
    gaps: list[float] = []

    async def upload() -> None:
        code, reader, writer = await socks_connect(gang.socks[0], gang.addresses[1], ports[0])
        assert code == 0
        for _ in range(size >> 20):
            writer.write(pattern)
            await writer.drain()
        writer.write_eof()
        results["upload"] = (await asyncio.wait_for(reader.read(100), 60)).decode()
        writer.close()

    async def download() -> None:
        code, reader, writer = await socks_connect(gang.socks[0], gang.addresses[1], ports[1])
        assert code == 0
        digest = hashlib.sha256()
        last = time.monotonic()
        while data := await asyncio.wait_for(reader.read(1 << 16), 30):
            now = time.monotonic()
            gaps.append(now - last)
            last = now
            digest.update(data)
        results["download"] = digest.hexdigest()
        writer.close()

    async def chatter(idle: float) -> None:
        code, reader, writer = await socks_connect(gang.socks[0], gang.addresses[1], ports[2])
        assert code == 0
        for index in range(30):
            message = f"request {index}".encode()
            writer.write(message)
            assert await asyncio.wait_for(reader.readexactly(len(message)), 10) == message.upper()
            await asyncio.sleep(idle)
        writer.close()
        results[f"chatter-{idle}"] = "ok"

    async def kill_midway() -> None:
        await asyncio.sleep(0.5)
        await crash(carrying)

    async with sink_server, source_server, echo:
        await asyncio.wait_for(
            asyncio.gather(upload(), download(), chatter(0.02), chatter(0.1), kill_midway()), 90
        )
    assert results == {
        "upload": expected,
        "download": expected,
        "chatter-0.02": "ok",
        "chatter-0.1": "ok",
    }
    assert tunnel.home is not None and tunnel.home.name != carrying.name
    resets_after = total("nodus_agent_stream_resets")
    assert resets_after == resets_before
    assert max(gaps) < 1.0, f"longest delivery gap {max(gaps):.3f} s"


async def test_a_connect_to_a_member_whose_agent_stopped_is_unreachable_at_once(
    gang: Gang,
) -> None:
    echo = await start_echo(gang.addresses[1])
    port = echo.sockets[0].getsockname()[1]
    async with echo:
        await echo_works(gang, port)
        await gang.agents[1].stop()
        tunnel = tunnel_of(gang, 0)
        peer = tunnel.peers_by_address[gang.addresses[1]]

        async def gone() -> bool:
            return not tunnel.reachable(peer)

        await eventually(gone, timeout=5)
        started = time.monotonic()
        code, _, writer = await socks_connect(gang.socks[0], gang.addresses[1], port)
        elapsed = time.monotonic() - started
        writer.close()
    assert code == 4  # host unreachable: the shim's EHOSTUNREACH
    assert elapsed < 1.0


async def test_a_server_that_writes_and_closes_at_once_is_read_to_the_end(gang: Gang) -> None:
    """A banner and a FIN the peer sends as soon as it accepts can arrive before our side of
    the stream is attached to the program's socket: both must reach the program."""
    banner = b"220 hello, and goodbye\r\n" * 100

    async def greeter(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(banner)
        writer.write_eof()
        await writer.drain()
        await reader.read()  # until the client closes too
        writer.close()

    server = await asyncio.start_server(greeter, gang.addresses[1], 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        for _ in range(20):
            code, reader, writer = await socks_connect(gang.socks[0], gang.addresses[1], port)
            assert code == 0
            assert await asyncio.wait_for(reader.read(), 5) == banner  # read() ends at EOF
            writer.close()

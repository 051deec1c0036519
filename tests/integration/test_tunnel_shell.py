"""The tunnel's asyncio shell on its own: two members' tunnels through one relay on 127.0.0.1
(the relay reads its members from a real nats-server), member A's SOCKS5 entry in front.
What a user notices: timers fire when due and an idle tunnel sleeps; a local program that
resets its connection resets that stream alone."""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from libs.bus import Bus
from libs.bus.server import free_port
from services.agent.relayed.socks import SocksFront
from services.agent.relayed.tunnel import Tunnel
from services.agent.relayed.wgdevice import WgDevice
from services.relay.relay import Relay
from tests.conftest import eventually
from tests.integration.conftest import MESH_KEY, Node, enrol, known, metric
from tests.socks_client import socks_connect

GANG = "acme.tn"
ADDRESSES = ("127.0.1.41", "127.0.1.42")


@dataclass
class Members:
    relay: Relay
    nodes: tuple[Node, Node]
    tunnels: tuple[Tunnel, Tunnel]
    socks: SocksFront  # member A's entry

    @property
    def socks_address(self) -> tuple[str, int]:
        return self.socks.listen

    def peer_of(self, i: int) -> object:
        return self.tunnels[i].peers_by_key[self.nodes[1 - i].public]


@pytest.fixture
async def members(bus: Bus) -> AsyncIterator[Members]:
    relay = Relay(bus, "relay-t", "eu-central", ("127.0.0.1", free_port()), [], MESH_KEY)
    await relay.start()
    nodes = (Node(GANG, 1, "a"), Node(GANG, 1, "b"))
    await enrol(bus, GANG, 1, list(nodes))
    await known((relay, relay), *nodes)
    tunnels = tuple(
        Tunnel(
            n.name,
            GANG,
            1,
            ADDRESSES[i],
            WgDevice(n.private),
            [(relay.name, relay.address, None)],
            totals={relay.name},
        )
        for i, n in enumerate(nodes)
    )
    for i, tunnel in enumerate(tunnels):
        other = nodes[1 - i]
        tunnel.add_peer(other.name, ADDRESSES[1 - i], other.public)
    socks = SocksFront(tunnels[0], ("127.0.0.1", free_port()))
    members = Members(relay, nodes, (tunnels[0], tunnels[1]), socks)
    yield members
    await socks.stop()
    for tunnel in tunnels:
        await tunnel.stop()
    await relay.stop()


async def start(members: Members, *which: int) -> None:
    for i in which:
        await members.tunnels[i].start()
        await members.tunnels[i].wait_ready()
    if 0 in which:
        await members.socks.start()


async def heard_each_other(members: Members) -> None:
    async def both() -> bool:
        return all(
            members.tunnels[i].peers_by_key[members.nodes[1 - i].public].heard for i in (0, 1)
        )

    await eventually(both, timeout=5)


async def test_an_idle_tunnel_sleeps_between_keepalives(members: Members) -> None:
    await start(members, 0, 1)
    await heard_each_other(members)
    tunnel = members.tunnels[0]
    peer = tunnel.peers_by_key[members.nodes[1].public]
    await asyncio.sleep(0.1)
    woken = tunnel.timer_wakeups
    await asyncio.sleep(1.0)
    # Four keepalives a second (KEEPALIVE), not the 50 wakeups of a 20 ms poll ...
    assert tunnel.timer_wakeups - woken <= 10
    # ... and they did go out: the peer heard from us, we from it, a moment ago.
    assert time.monotonic() - peer.heard < 0.5
    other = members.tunnels[1].peers_by_key[members.nodes[0].public]
    assert time.monotonic() - other.heard < 0.5


async def test_a_handshake_nobody_answered_is_retried_at_its_deadline(
    members: Members, monkeypatch: pytest.MonkeyPatch
) -> None:
    from libs.wg import device as wg_device
    from libs.wg import timers as wg_timers

    monkeypatch.setattr(wg_timers, "REKEY_TIMEOUT", 0.2)
    monkeypatch.setattr(wg_device, "REKEY_TIMEOUT_JITTER", 0.0)
    no_route = metric("nodus_relay_frames_dropped_total", reason="no_route")
    await start(members, 0)  # B is not there: the relay has nowhere to take A's initiations

    async def retried() -> bool:
        return metric("nodus_relay_frames_dropped_total", reason="no_route") >= no_route + 3

    began = time.monotonic()
    await eventually(retried, timeout=2)
    assert time.monotonic() - began < 1.0  # the first try and two retries 0.2 s apart
    await start(members, 1)
    await heard_each_other(members)  # once B is there, the handshake completes


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close like a program that sets SO_LINGER 0: the peer gets an RST, not a FIN."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def test_a_local_reset_resets_only_its_own_stream(members: Members) -> None:
    await start(members, 0, 1)

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1 << 16):
            writer.write(data.upper())
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(echo, ADDRESSES[1], 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        streams = []
        for word in (b"first", b"second"):
            code, reader, writer = await socks_connect(members.socks_address, ADDRESSES[1], port)
            assert code == 0
            writer.write(word)
            assert await asyncio.wait_for(reader.read(100), 5) == word.upper()
            streams.append((reader, writer))
        a, b = members.tunnels
        local = metric("nodus_agent_stream_resets_total", node="a", reason="local_reset")
        peer = metric("nodus_agent_stream_resets_total", node="b", reason="peer")
        _reset(streams[0][1])

        async def reset_on_both_sides() -> bool:
            return (
                metric("nodus_agent_stream_resets_total", node="a", reason="local_reset")
                == local + 1
                and metric("nodus_agent_stream_resets_total", node="b", reason="peer") == peer + 1
            )

        await eventually(reset_on_both_sides, timeout=5)
        reader, writer = streams[1]
        writer.write(b"still open")
        assert await asyncio.wait_for(reader.read(100), 5) == b"STILL OPEN"
        assert len(a.bridges) == 1 and len(b.bridges) == 1
        writer.close()


async def test_the_relay_hears_what_the_members_programs_sent_counted_once(
    members: Members,
) -> None:
    """The relay meters every message it carries; the member tells it what its programs sent,
    once (a resend is not in it: tests/unit/test_link.py). With nothing lost they agree to the
    byte."""
    await start(members, 0, 1)
    received = bytearray()

    async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1 << 16):
            received.extend(data)
        writer.close()

    server = await asyncio.start_server(sink, ADDRESSES[1], 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        code, _, writer = await socks_connect(members.socks_address, ADDRESSES[1], port)
        assert code == 0
        writer.write(b"z" * (3 << 20))
        await writer.drain()

        async def arrived() -> bool:
            return len(received) == 3 << 20

        await eventually(arrived, timeout=10)
        a = members.tunnels[0]
        slot = members.relay.meter.journal.slots[(GANG, 1, "a")]

        async def told() -> bool:
            return slot.reported == a.sent_once

        await eventually(told, timeout=5)
        assert slot.counted == slot.reported  # nothing was sent twice
        assert 3 << 20 < slot.reported < (3 << 20) * 1.001, slot.reported
        writer.close()

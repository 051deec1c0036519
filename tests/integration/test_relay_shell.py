"""The relay's asyncio shell on its own: one relay on 127.0.0.1 (its members read from a real
nats-server) and member clients speaking the relay protocol. What a user notices: frames for
a member that is gone are dropped and counted while the sender's session goes on; a member
that sends garbage loses its own session and nobody else's, and its peers are told."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from libs.bus import Bus
from libs.bus.server import free_port
from services.relay.relay import Relay
from tests.conftest import eventually
from tests.integration.conftest import MESH_KEY, Node, connected, enrol, known, metric, wg_shaped

GANG = "acme.rs"
DROPPED = "nodus_relay_frames_dropped_total"


@pytest.fixture
async def relay(bus: Bus) -> AsyncIterator[Relay]:
    relay = Relay(bus, "relay-s", "eu-central", ("127.0.0.1", free_port()), [], MESH_KEY)
    await relay.start()
    yield relay
    await relay.stop()


async def members(bus: Bus, relay: Relay, *names: str) -> list[Node]:
    nodes = [Node(GANG, 1, name) for name in names]
    await enrol(bus, GANG, 1, nodes)
    await known((relay, relay), *nodes)
    return nodes


async def test_frames_for_a_gone_member_are_dropped_and_counted_while_the_sender_goes_on(
    bus: Bus, relay: Relay
) -> None:
    a, b, c = await members(bus, relay, "a", "b", "c")
    to_a, to_b, _ = [await connected(n, relay) for n in (a, b, c)]
    session = relay.sessions[a.public]
    to_b.close()

    async def b_gone() -> bool:
        return b.public not in relay.sessions and b.public not in to_a.present

    await eventually(b_gone, timeout=5)  # ... and a was told b is unreachable
    dropped = metric(DROPPED, reason="no_route")
    for _ in range(3):
        assert to_a.send_now(b.public, wg_shaped(100))
    to_a.send_now(c.public, wg_shaped(100, fill=0x43))
    src, message = await asyncio.wait_for(c.inbox.get(), 5)
    assert (src, message) == (a.public, wg_shaped(100, fill=0x43))
    assert metric(DROPPED, reason="no_route") == dropped + 3
    assert relay.sessions[a.public] is session and to_a.up


async def test_a_member_sending_garbage_loses_its_own_session_only(bus: Bus, relay: Relay) -> None:
    a, b, c = await members(bus, relay, "a", "b", "c")
    to_a, to_b, _ = [await connected(n, relay) for n in (a, b, c)]

    async def all_present() -> bool:
        return {a.public, c.public} <= to_b.present

    await eventually(all_present, timeout=5)
    malformed = metric(DROPPED, reason="malformed")
    sessions = {k: relay.sessions[k] for k in (b.public, c.public)}
    assert to_a.conn is not None
    to_a.conn.send_all([b"\xff\xff\xff\xff" + bytes(8)])  # a frame length no frame has

    async def a_dropped() -> bool:
        return a.public not in relay.sessions and a.public not in to_b.present

    await eventually(a_dropped, timeout=5)
    assert metric(DROPPED, reason="malformed") == malformed + 1
    assert {k: relay.sessions.get(k) for k in sessions} == sessions
    assert to_b.send_now(c.public, wg_shaped(64))
    assert await asyncio.wait_for(c.inbox.get(), 5) == (b.public, wg_shaped(64))

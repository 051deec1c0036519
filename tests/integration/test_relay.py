"""Relays on a real bus: members authenticate with their epoch's WireGuard key, frames flow
only between members of one gang epoch, meshed relays reach each other's members, fenced
epochs are cut off, malformed input is a counted drop, and bytes are metered once."""

from __future__ import annotations

import asyncio

import pytest

from libs.bus import Bus
from libs.client.client import Client
from libs.contracts import names
from libs.contracts.epochs import Epoch
from libs.contracts.errors import NodusError
from libs.relayproto import encode
from libs.relayproto.frames import Send
from services.relay.mesh import RECONNECT_DELAY
from services.relay.relay import Relay
from tests.integration.conftest import (
    Node,
    connected,
    counted,
    enrol,
    known,
    metric,
    wg_shaped,
)


async def present_everywhere(relays: tuple[Relay, Relay], *nodes: Node) -> None:
    """Wait until each relay knows where every node is homed (presence crossed the mesh)."""
    for _ in range(200):
        if all(
            n.public in r.sessions or any(n.public in p for p in r.mesh.remote.values())
            for r in relays
            for n in nodes
        ):
            return
        await asyncio.sleep(0.02)
    raise AssertionError("presence did not cross the mesh")


async def test_members_on_different_relays_reach_each_other_through_the_mesh(
    bus: Bus, relays: tuple[Relay, Relay]
) -> None:
    a, b = Node("acme.rl", 1, "a"), Node("acme.rl", 1, "b")
    await enrol(bus, "acme.rl", 1, [a, b])
    await known(relays, a, b)
    client_a = await connected(a, relays[0])
    client_b = await connected(b, relays[1])
    await present_everywhere(relays, a, b)
    message = wg_shaped(100)
    assert client_a.send_now(b.public, message)
    src, got = await asyncio.wait_for(b.inbox.get(), 5)
    assert (src, got) == (a.public, message)
    assert client_b.send_now(a.public, wg_shaped(10, 0x42))
    src, got = await asyncio.wait_for(a.inbox.get(), 5)
    assert src == b.public and got == wg_shaped(10, 0x42)
    client_a.close()
    client_b.close()


async def test_a_relay_given_its_own_address_to_mesh_with_links_only_to_the_others(
    bus: Bus, relays: tuple[Relay, Relay]
) -> None:
    # Each was given both addresses (one relay.env for every relay of a host, say).
    for _ in range(100):
        if all(len(r.mesh.peers) == 1 for r in relays):
            break
        await asyncio.sleep(0.05)
    for _ in range(2):  # and still so past a reconnect delay: it does not dial itself again
        for relay, other in (relays, relays[::-1]):
            assert [p.name for p in relay.mesh.peers.values()] == [other.name]
            assert set(relay.mesh.remote) == {other.name}
        await asyncio.sleep(RECONNECT_DELAY * 2)


async def test_nobody_outside_the_gang_epoch_gets_through(
    bus: Bus, relays: tuple[Relay, Relay]
) -> None:
    a, b = Node("acme.rl", 1, "a"), Node("acme.rl", 1, "b")
    other = Node("globex.x", 1, "c")
    await enrol(bus, "acme.rl", 1, [a, b])
    await enrol(bus, "globex.x", 1, [other, Node("globex.x", 1, "d")])
    await known(relays, a, b, other)
    await connected(b, relays[0])
    intruder = await connected(other, relays[0])
    await present_everywhere(relays, b)
    before = metric("nodus_relay_frames_dropped_total", reason="not_same_gang_epoch")
    intruder.send_now(b.public, wg_shaped(64))
    await counted("nodus_relay_frames_dropped_total", before + 1, reason="not_same_gang_epoch")
    assert b.inbox.empty()

    # A stranger's key, a wrong proof, a claim to another node: refused at hello, counted.
    stranger = Node("acme.rl", 1, "a")  # claims to be a, with a key nobody recorded
    with pytest.raises(NodusError, match="NotAMember"):
        await stranger.client(relays[0]).connect()
    forger = Node("acme.rl", 1, "a")
    forger.public = a.public  # a's public key without a's private key
    with pytest.raises(NodusError, match="BadProof"):
        await forger.client(relays[0]).connect()
    assert metric("nodus_relay_sessions_refused_total", reason="bad_proof") >= 1


async def test_a_fenced_epoch_is_cut_off(bus: Bus, relays: tuple[Relay, Relay]) -> None:
    a, b = Node("acme.rl", 1, "a"), Node("acme.rl", 1, "b")
    await enrol(bus, "acme.rl", 1, [a, b])
    await known(relays, a, b)
    client_a = await connected(a, relays[0])
    epochs = bus.bucket(names.BUCKET_EPOCHS, Epoch)
    current = await epochs.get(names.epoch_key("acme.rl", 1))
    assert current is not None
    current.value.fenced = True
    await epochs.put(names.epoch_key("acme.rl", 1), current.value)
    for _ in range(50):
        if not client_a.up:
            break
        await asyncio.sleep(0.05)
    assert not client_a.up
    with pytest.raises(NodusError, match="NotAMember"):
        await b.client(relays[1]).connect()


async def test_malformed_frames_and_non_wireguard_payloads_are_counted_drops(
    bus: Bus, relays: tuple[Relay, Relay]
) -> None:
    a, b = Node("acme.rl", 1, "a"), Node("acme.rl", 1, "b")
    await enrol(bus, "acme.rl", 1, [a, b])
    await known(relays, a, b)
    client_a = await connected(a, relays[0])
    await connected(b, relays[0])
    before = metric("nodus_relay_frames_dropped_total", reason="not_wireguard")
    client_a.send_now(b.public, b"plaintext that is not WireGuard")
    await counted("nodus_relay_frames_dropped_total", before + 1, reason="not_wireguard")
    assert b.inbox.empty()
    # Garbage on a fresh connection: the relay drops it and keeps serving.
    host, port = relays[0].listen
    reader, writer = await asyncio.open_connection(host, port)
    await reader.read(100)  # the challenge
    writer.write(b"\xff\xff\xff\xff garbage")
    await writer.drain()
    assert await asyncio.wait_for(reader.read(), 5) is not None
    writer.close()
    client_a.send_now(b.public, wg_shaped(32))
    src, _ = await asyncio.wait_for(b.inbox.get(), 5)
    assert src == a.public


async def test_the_bytes_each_members_programs_send_are_metered_once(
    bus: Bus, relays: tuple[Relay, Relay]
) -> None:
    a, b = Node("acme.rl", 1, "a"), Node("acme.rl", 1, "b")
    await enrol(bus, "acme.rl", 1, [a, b])
    await known(relays, a, b)
    client_a = await connected(a, relays[0])
    await connected(b, relays[1])
    await present_everywhere(relays, a, b)
    sent = 0
    for _ in range(20):
        message = wg_shaped(1000)
        client_a.send_now(b.public, message)
        sent += len(message) - 32  # billed: the plaintext, not WireGuard's header and tag
    client_a.send_now(b.public, wg_shaped(0))  # a keepalive carries nothing: not billed
    for _ in range(21):
        await asyncio.wait_for(b.inbox.get(), 5)
    await relays[0].meter.flush()
    await relays[0].meter.flush()  # a second flush must not count again
    usage = await Client(bus).usage()  # what `nodus usage` shows, from the usage stream
    assert usage == {"acme.rl": sent}
    # The relay that only forwarded over the mesh bills nothing for a.
    assert ("acme.rl", 1, "a") not in relays[1].meter.counts or relays[1].meter.counts[
        ("acme.rl", 1, "a")
    ] == 0
    # a says what its programs sent, once: part of the above was a resend. That is the bill.
    client_a.send_many([(b.public, wg_shaped(1000))], sent=sent - 3000)
    await asyncio.wait_for(b.inbox.get(), 5)
    await relays[0].meter.flush()
    assert await Client(bus).usage() == {"acme.rl": sent - 3000}


def test_frames_encode_only_what_fits() -> None:
    with pytest.raises(ValueError):
        encode(Send(b"k" * 32, b"x" * (1 << 18)))

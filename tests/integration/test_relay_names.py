"""A relay's name is its own: records, usage ids and bills are keyed by it, so a second relay
given a live relay's name (two hosts with one hostname) does not start, and says why, while a
relay started again (its key kept, or its predecessor silent) takes its name back."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec
import pytest

from libs.bus import Bus
from libs.bus.auth import RELAY
from libs.bus.server import NatsServer, free_port
from libs.contracts import names
from libs.contracts.relay import RelayRecord
from services.relay import announce
from services.relay.announce import NameTaken
from services.relay.relay import Relay
from tests.conftest import eventually
from tests.integration.conftest import MESH_KEY
from tests.relay_processes import nodus_relay, stderr_once_exited

REPO = Path(__file__).resolve().parents[2]


def relay(bus: Bus, name: str, key: bytes | None = None) -> Relay:
    return Relay(bus, name, "eu-central", ("127.0.0.1", free_port()), [], MESH_KEY, private_key=key)


async def holder(bus: Bus, name: str) -> RelayRecord:
    found = await bus.bucket(names.BUCKET_RELAYS, RelayRecord).get(name)
    assert found is not None
    return found.value


async def test_a_relay_given_a_live_relays_name_does_not_start(bus: Bus) -> None:
    first = relay(bus, "relay-x")
    await first.start()
    try:
        await eventually(_holds(bus, first))
        second = relay(bus, "relay-x")
        with pytest.raises(NameTaken, match=first.address):
            await second.start()
        assert second.server is None  # it never listened
        await asyncio.sleep(announce.ANNOUNCE_EVERY * 1.5)
        record = await holder(bus, "relay-x")
        assert record.address == first.address  # members still dial the first
        assert not first.failed.done()
    finally:
        await first.stop()


async def test_a_relay_started_again_with_its_key_holds_its_name_at_once(bus: Bus) -> None:
    key = os.urandom(32)
    first = relay(bus, "relay-k", key)
    await first.start()
    await first.stop()
    again = relay(bus, "relay-k", key)
    started = time.monotonic()
    await again.start()
    try:
        assert time.monotonic() - started < announce.CLAIM_WAIT / 2
        await eventually(_holds(bus, again))
    finally:
        await again.stop()


async def test_a_relay_whose_predecessor_died_takes_its_name(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Restarted without --key-file: a new key, and its last life's record still looks live.
    monkeypatch.setattr(announce, "CLAIM_WAIT", 1.0)
    first = relay(bus, "relay-d")
    await first.start()
    await first.stop()
    successor = relay(bus, "relay-d")
    await successor.start()
    try:
        await eventually(_holds(bus, successor))
        assert not successor.failed.done()
    finally:
        await successor.stop()


async def test_of_two_relays_started_at_once_with_one_name_one_starts(bus: Bus) -> None:
    twins = [relay(bus, "relay-t"), relay(bus, "relay-t")]
    started = await asyncio.gather(*(r.start() for r in twins), return_exceptions=True)
    try:
        assert sorted(type(outcome).__name__ for outcome in started) == ["NameTaken", "NoneType"]
        kept = twins[started.index(None)]
        await asyncio.sleep(announce.ANNOUNCE_EVERY * 1.5)  # and it goes on announcing
        assert (await holder(bus, "relay-t")).public_key == kept.announcer.public_key
        assert not kept.failed.done()
    finally:
        for r in twins:
            await r.stop()


def _holds(bus: Bus, relay_: Relay) -> Callable[[], Awaitable[bool]]:
    async def holds_its_name() -> bool:
        record = await holder(bus, relay_.name)
        return record.public_key == relay_.announcer.public_key and (
            record.address == relay_.address
        )

    return holds_its_name


async def test_nodus_relay_given_another_relays_bus_user_exits_with_the_reason(
    bus: Bus, nats_server: NatsServer, tmp_path: Path
) -> None:
    # One seed for every relay (a Kubernetes secret shared by the pods, a copied file): the
    # bus would refuse this relay's record, and members would never find it.
    theirs = nats_server.user("relay-a", RELAY, "relay-a")
    relay_b = nodus_relay(nats_server, tmp_path, "relay-b", theirs, slot="relay-0")
    said = await stderr_once_exited(relay_b)
    assert relay_b.returncode == 1, said
    assert "relay 'relay-b': the bus user of --credentials is relay 'relay-a''s" in said
    assert "nodus bus user --relay relay-b" in said


async def test_nodus_relay_given_a_taken_name_exits_with_the_reason(
    bus: Bus, nats_server: NatsServer, tmp_path: Path
) -> None:
    credentials = nats_server.user("relay-h", RELAY, "relay-h")

    def start(index: int) -> subprocess.Popen[bytes]:
        return nodus_relay(nats_server, tmp_path, "relay-h", credentials, slot=f"relay-{index}")

    relays = bus.bucket(names.BUCKET_RELAYS, RelayRecord)
    first = start(0)
    try:

        async def announced() -> bool:
            if first.poll() is not None:
                raise AssertionError(f"the first relay exited: {first.communicate()[1]!r}")
            return await relays.get("relay-h") is not None

        await eventually(announced, timeout=30)
        # The key file it made is its alone.
        assert (tmp_path / "relay-0" / "relay.key").stat().st_mode & 0o077 == 0
        second = start(1)
        said = await stderr_once_exited(second)
        assert second.returncode == 1, said
        assert "relay name 'relay-h' is held by another live relay" in said
        assert "give each its own --name" in said
        assert first.poll() is None, first.communicate()[1]  # the first goes on
    finally:
        if first.poll() is None:
            first.terminate()
            await stderr_once_exited(first, within=15)


async def test_a_relay_whose_name_another_took_while_it_ran_stops(bus: Bus) -> None:
    # Its bus was cut for longer than a claim's wait, and another relay took the name.
    first = relay(bus, "relay-r")
    await first.start()
    try:
        await eventually(_holds(bus, first))
        taken = msgspec.structs.replace(
            await holder(bus, "relay-r"), public_key="b3RoZXI=", address="127.0.0.1:9"
        )
        await bus.bucket(names.BUCKET_RELAYS, RelayRecord).put("relay-r", taken)
        with pytest.raises(NameTaken, match=r"127\.0\.0\.1:9"):
            await asyncio.wait_for(asyncio.shield(first.failed), announce.ANNOUNCE_EVERY * 3)
    finally:
        await first.stop()

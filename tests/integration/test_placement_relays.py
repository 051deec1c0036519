"""Which relays a gang's members home on, with a real nats-server and placer: spread evenly
over the least loaded of every live relay, and the nearest their region (G15)."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from datetime import timedelta

import pytest

from libs.bus import Bus
from libs.client.client import Client
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.epochs import Epoch
from libs.contracts.fleet import Machine
from libs.contracts.jobs import Job
from libs.contracts.relay import CAPABILITY_EPOCH_RELAYS, RelayRecord
from services.agent.inventory import capabilities_of
from tests.conftest import StartPlacer, placed
from tests.factories import job, machine, node_record, register

L4 = {"count": 1, "backend": "cuda", "model": "L4"}


def l4_containers(count: int) -> list[Machine]:
    """Container-only L4 machines `vast-00`.. (any gang of them is Relayed), in name order."""
    return [
        machine(
            f"vast-{i:02}",
            provider="vast",
            offering="container",
            address=f"10.9.1.{i + 1}",
            accelerators=L4,
        )
        for i in range(count)
    ]


async def announce(
    bus: Bus, regions: dict[str, str], silent: dict[str, float] | None = None
) -> None:
    """Relay records as relays write them, `name: region`; each heard from `silent[name]`
    seconds ago (default: now, a live relay)."""
    records = bus.bucket(names.BUCKET_RELAYS, RelayRecord)
    t = now()
    for index, (name, region) in enumerate(regions.items()):
        await records.put(
            name,
            RelayRecord(
                name=name,
                region=region,
                address=f"127.0.0.1:{4430 + index}",
                public_key="",
                version="test",
                capabilities=["relay-v1", CAPABILITY_EPOCH_RELAYS],
                heartbeat_time=t - timedelta(seconds=(silent or {}).get(name, 0.0)),
            ),
        )


async def eight_gangs_at_once(bus: Bus, start_placer: StartPlacer) -> list[Job]:
    """8 Relayed gangs of 2 applied at once on 16 containers, once placed."""
    await register(bus, [node_record(m) for m in l4_containers(16)])
    await start_placer()
    client = Client(bus)
    spec = {"accelerators": {"model": "L4"}, "distributed": {"members": 2, "transport": "Auto"}}
    names_ = [f"rl-{i}" for i in range(8)]
    await asyncio.gather(*(client.apply(job(name, org="acme", **spec)) for name in names_))
    return [await placed(bus, f"acme.{name}") for name in names_]


async def test_named_relays_spread_evenly_over_gangs_committed_together(
    bus: Bus, start_placer: StartPlacer
) -> None:
    """8 gangs applied at once are planned and committed in one batch: each sees the load of
    those committed with it, so every one of four relays carries 4 members."""
    await announce(bus, {f"relay-{i}": "eu" for i in range(4)})
    homes: Counter[str] = Counter()
    for placed_job in await eight_gangs_at_once(bus, start_placer):
        gang = placed_job.status.gang
        assert gang is not None and len(gang.relays) == 2, gang
        homes.update(gang.relays[m.relay_slot or 0] for m in gang.members)
    assert homes == {f"relay-{i}": 4 for i in range(4)}, homes


async def test_relayed_members_applied_at_once_spread_evenly_across_the_two_relays(
    bus: Bus, start_placer: StartPlacer
) -> None:
    gangs = await eight_gangs_at_once(bus, start_placer)
    slots = [m.relay_slot for g in gangs if g.status.gang for m in g.status.gang.members]
    assert slots.count(0) == slots.count(1) == 8, slots
    epochs = bus.bucket(names.BUCKET_EPOCHS, Epoch)
    for gang in gangs:
        assert gang.status.gang is not None
        record = await epochs.get(names.epoch_key(gang.key, gang.status.epoch))
        assert record is not None
        assert [m.relay_slot for m in record.value.members] == [
            m.relay_slot for m in gang.status.gang.members
        ]


async def test_relayed_gangs_get_the_least_loaded_two_of_every_live_relay(
    bus: Bus, start_placer: StartPlacer
) -> None:
    """Four relays (say one per core of two relay hosts): 8 gangs of 2 take two each, the
    least loaded, so every relay carries 4 members and each gang's members split over its two;
    the job and the epoch name the same relays, and a relay whose heartbeat stopped is left
    out. An agent without named relays (older) keeps its gang on the first two by name."""
    # relay-4 stopped announcing a minute ago
    await announce(bus, {f"relay-{i}": "eu" for i in range(5)}, silent={"relay-4": 60.0})
    fleet = l4_containers(18)
    older = [m for m in fleet if m.name in ("vast-16", "vast-17")]
    await register(
        bus,
        [node_record(m) for m in fleet if m not in older]
        + [
            node_record(m, capabilities=[c for c in capabilities_of(m) if c != "epoch-relays"])
            for m in older
        ],
    )
    await start_placer()
    client = Client(bus)
    spec = {"accelerators": {"model": "L4"}, "distributed": {"members": 2, "transport": "Auto"}}
    for index in range(8):  # one after the other: each sees the load of those before
        await client.apply(job(f"rl-{index}", org="acme", **spec))
        await placed(bus, f"acme.rl-{index}")
    homes: Counter[str] = Counter()
    epochs = bus.bucket(names.BUCKET_EPOCHS, Epoch)
    for index in range(8):
        gang = (await placed(bus, f"acme.rl-{index}")).status
        assert gang.gang is not None and len(gang.gang.relays) == 2, gang
        assert "relay-4" not in gang.gang.relays
        assert sorted(m.relay_slot or 0 for m in gang.gang.members) == [0, 1]
        homes.update(gang.gang.relays[m.relay_slot or 0] for m in gang.gang.members)
        record = await epochs.get(names.epoch_key(f"acme.rl-{index}", gang.epoch))
        assert record is not None and record.value.relays == gang.gang.relays
    assert homes == {f"relay-{i}": 4 for i in range(4)}
    # Only the two older machines are left: their gang names no relays.
    await client.apply(job("old", org="acme", **spec))
    old = (await placed(bus, "acme.old")).status.gang
    assert (
        old is not None
        and old.relays == []
        and {m.node for m in old.members}
        == {
            "vast-16",
            "vast-17",
        }
    )


async def test_relayed_gangs_get_relays_of_their_region(
    bus: Bus, start_placer: StartPlacer
) -> None:
    """Relays in us-east-1, in the class us, in eu-west-1, in the class eu, and one in a region
    with no machines: each gang gets the relays of its members' region, homed on the one of
    their own region, never on the idle relay far away. A region without a relay of its own
    (us-west-2) gets its class's, a relay of us-east-1 counting as one of class us."""
    regions = {
        "relay-use1": "us-east-1",
        "relay-us": "us",
        "relay-euw1": "eu-west-1",
        "relay-eu": "eu",
        "relay-ap": "ap-south-1",
    }
    await announce(bus, regions)
    where = {"use1": ("us-east-1", "us"), "euw1": ("eu-west-1", "eu"), "usw2": ("us-west-2", "us")}
    fleet = [
        machine(
            f"{place}-{i}",
            provider="vast",
            offering="container",
            region=region,
            regionClass=region_class,
            address=f"10.9.{index}.{i + 1}",
            accelerators=L4,
        )
        for index, (place, (region, region_class)) in enumerate(where.items())
        for i in range(2)
    ]
    await register(bus, [node_record(m) for m in fleet])
    await start_placer()
    client = Client(bus)
    spec = {
        "accelerators": {"model": "L4"},
        "distributed": {"members": 2, "transport": "Auto", "network": "Colocated"},
    }
    gangs = {}
    for index in range(3):  # one after the other: each sees the load of those before
        await client.apply(job(f"rg-{index}", org="acme", **spec))
        status = (await placed(bus, f"acme.rg-{index}")).status.gang
        assert status is not None
        place = {m.node.split("-")[0] for m in status.members}
        assert len(place) == 1, status  # Colocated: one region
        homes = [status.relays[m.relay_slot or 0] for m in status.members]
        gangs[place.pop()] = (status.relays, homes)
    assert gangs["use1"] == (["relay-us", "relay-use1"], ["relay-use1", "relay-use1"])
    assert gangs["euw1"] == (["relay-eu", "relay-euw1"], ["relay-euw1", "relay-euw1"])
    relays, homes = gangs["usw2"]
    assert relays == ["relay-us", "relay-use1"] and set(homes) <= set(relays), gangs


async def test_the_placer_warns_once_of_a_relay_near_no_machine(
    bus: Bus, start_placer: StartPlacer, caplog: pytest.LogCaptureFixture
) -> None:
    """A mistyped --region makes a relay far from every gang: the placer says so, once."""
    await announce(bus, {"relay-a": "us-east-1", "relay-b": "us-eats-1"})
    await register(bus, [node_record(m) for m in l4_containers(2)])  # us-east-1, class us
    placer = await start_placer()
    caplog.set_level(logging.WARNING, logger="nodus.placer")
    for _ in range(2):
        placer._warn_of_far_relays()  # what its sweep does every 15 s
    said = [r.getMessage() for r in caplog.records if "mistyped" in r.getMessage()]
    assert len(said) == 1 and "relay-b has region us-eats-1" in said[0], said

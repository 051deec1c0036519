"""The relays the placement bench announces before its burst, and how near the Relayed
members it placed home (their region or region class)."""

from __future__ import annotations

from libs.bus import Bus
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.fleet import NodeRecord
from libs.contracts.relay import CAPABILITY_EPOCH_RELAYS, RelayRecord
from libs.jobs.relays import Whereabouts, nearness
from tests.bench.placement_report import Burst

# Relays a real deployment has: by region class, and one in the region of the largest
# container marketplace. Relayed gangs get two each (the nearest, then the least loaded), and
# Direct gangs a fallback pair: the bench times that choice with the rest of a decision.
BENCH_RELAYS = [
    ("relay-us-1", "us"),
    ("relay-us-2", "us"),
    ("relay-use2", "us-east-2"),
    ("relay-eu-1", "eu"),
    ("relay-eu-2", "eu"),
    ("relay-ap", "ap"),
]


async def announce_relays(bus: Bus, count: int) -> None:
    """The relays' heartbeats, fresh for the burst (RELAY_FRESH_SECONDS)."""
    records = bus.bucket(names.BUCKET_RELAYS, RelayRecord)
    for index, (name, region) in enumerate(BENCH_RELAYS[:count]):
        await records.put(
            name,
            RelayRecord(
                name=name,
                region=region,
                address=f"198.18.200.{index + 1}:443",
                public_key="",
                version="bench",
                capabilities=[CAPABILITY_EPOCH_RELAYS],
                heartbeat_time=now(),
            ),
        )


def homed_near(burst: Burst, fleet: list[NodeRecord], relays: int) -> int:
    """How many Relayed members home on a relay of their region or region class."""
    where = {r.inventory.node: r.inventory for r in fleet}
    regions = dict(BENCH_RELAYS[:relays])
    classes = {i.region: i.region_class for i in where.values()}
    return sum(
        nearness(regions[relay], Whereabouts(where[node].region, where[node].region_class), classes)
        > 0
        for node, relay in burst.relay_homes
        if node in where and relay in regions
    )

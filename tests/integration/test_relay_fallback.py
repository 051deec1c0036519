"""Where a member homes when the placer's choice of relays is not there: a gang placed before
relays were named, or both its relays gone for the whole wait. It takes the live relays
nearest its own machine, not the first by name (which may be a continent away)."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta

from libs.bus import Bus
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.relay import RelayRecord
from libs.jobs.relays import Whereabouts
from services.agent.relayed.member import pick_relays

IN_EU_WEST = Whereabouts("eu-west-1", "eu")


async def announce(bus: Bus, name: str, region: str, silent_for: float = 0.0) -> None:
    record = RelayRecord(
        name=name,
        region=region,
        address=f"198.18.0.{len(name)}:443",
        public_key="",
        version="test",
        capabilities=[],
        heartbeat_time=now() - timedelta(seconds=silent_for),
    )
    await bus.bucket(names.BUCKET_RELAYS, RelayRecord).put(name, record)


async def fleet_of_relays(bus: Bus) -> None:
    await announce(bus, "relay-ap", "ap-south-1")  # first by name, far from Europe
    await announce(bus, "relay-eu", "eu")
    await announce(bus, "relay-euw1", "eu-west-1")
    await announce(bus, "relay-us", "us")
    await announce(bus, "relay-gone-a", "eu-west-1", silent_for=600)
    await announce(bus, "relay-gone-b", "eu", silent_for=600)


async def test_a_member_whose_gang_names_no_relays_takes_the_nearest(bus: Bus) -> None:
    await fleet_of_relays(bus)
    picked = await pick_relays(bus, [], IN_EU_WEST)
    assert [r.name for r in picked] == ["relay-euw1", "relay-eu"]


async def test_a_member_whose_named_relays_are_gone_falls_back_on_the_nearest(bus: Bus) -> None:
    await fleet_of_relays(bus)
    picked = await pick_relays(bus, ["relay-gone-a", "relay-gone-b"], IN_EU_WEST, wait=0.2)
    assert [r.name for r in picked] == ["relay-euw1", "relay-eu"]


async def test_a_member_that_does_not_say_where_it_is_takes_relays_by_name(bus: Bus) -> None:
    await fleet_of_relays(bus)
    picked = await pick_relays(bus, [], wait=0.2)
    assert [r.name for r in picked] == ["relay-ap", "relay-eu"]


async def test_gangs_whose_named_relays_are_gone_spread_over_the_equally_near_ones(
    bus: Bus,
) -> None:
    """A relay host lost takes both relays of many gangs: their members must not all land on
    the first of the equally near relays left by name."""
    await fleet_of_relays(bus)
    for side in "bcd":
        await announce(bus, f"relay-euw1-{side}", "eu-west-1")
    homes: Counter[str] = Counter()
    for index in range(40):
        gang = f"acme.job-{index}"
        gone = ["relay-gone-a", "relay-gone-b"]
        picked = await pick_relays(bus, gone, IN_EU_WEST, wait=0.0, gang=gang)
        assert {r.region for r in picked} == {"eu-west-1"}
        again = await pick_relays(bus, gone, IN_EU_WEST, wait=0.0, gang=gang)
        assert again == picked  # the gang's other members pick the same
        homes[picked[0].name] += 1
    assert len(homes) == 4 and max(homes.values()) <= 20, homes

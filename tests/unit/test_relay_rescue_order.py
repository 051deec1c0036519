"""Which relays a member turns to when its gang's own are gone (its relay host lost): the
nearest first, and among equally near ones an order of the gang's own, so that the gangs of
a lost host spread over the relays left instead of all landing on the first by name."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta

from libs.contracts.base import now
from libs.contracts.relay import RelayRecord
from libs.jobs.relays import Whereabouts, nearest_first

VIRGINIA = Whereabouts("us-east-1", "us")


def record(name: str, region: str = "us-east-1") -> RelayRecord:
    return RelayRecord(
        name=name,
        region=region,
        address="198.18.0.1:443",
        public_key="",
        version="0.1.0",
        capabilities=[],
        heartbeat_time=now() - timedelta(seconds=1),
    )


RELAYS = [record(f"relay-{i}") for i in range(8)] + [record("relay-far", region="eu-west-1")]


def test_without_a_gang_equally_near_relays_go_by_name_as_the_placer_counts_them() -> None:
    order = nearest_first(reversed(RELAYS), VIRGINIA)
    assert [r.name for r in order] == [f"relay-{i}" for i in range(8)] + ["relay-far"]


def test_the_gangs_of_a_lost_host_spread_evenly_over_the_equally_near_relays_left() -> None:
    gangs = [f"acme.job-{i}" for i in range(400)]
    first = Counter(nearest_first(RELAYS, VIRGINIA, spread=gang)[0].name for gang in gangs)
    assert set(first) == {f"relay-{i}" for i in range(8)}  # a far relay is never first
    assert max(first.values()) <= 2 * len(gangs) / 8, first  # by name: all 400 on relay-0


def test_members_of_one_gang_agree_on_its_order_and_the_nearest_still_comes_first() -> None:
    listed = nearest_first(RELAYS, VIRGINIA, spread="acme.train")
    assert nearest_first(list(reversed(RELAYS)), VIRGINIA, spread="acme.train") == listed
    assert listed[-1].name == "relay-far"
    ohio = Whereabouts("us-east-2", "us")
    near_ohio = [*RELAYS, record("relay-ohio", region="us-east-2")]
    assert nearest_first(near_ohio, ohio, spread="acme.train")[0].name == "relay-ohio"


def test_a_relay_gone_moves_only_the_gangs_that_put_it_first() -> None:
    gangs = [f"acme.job-{i}" for i in range(400)]
    before = {gang: nearest_first(RELAYS, VIRGINIA, spread=gang)[0].name for gang in gangs}
    left = [r for r in RELAYS if r.name != "relay-3"]
    after = {gang: nearest_first(left, VIRGINIA, spread=gang)[0].name for gang in gangs}
    moved = {gang for gang in gangs if before[gang] != after[gang]}
    assert moved == {gang for gang in gangs if before[gang] == "relay-3"}

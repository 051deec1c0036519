"""Which relays a Relayed gang gets: the nearest its members (their region, then their region
class), and among those the two least loaded of every live relay, so that adding relay
processes adds capacity; gangs whose agents or relays predate named relays keep using the
first two live relays by name, and count against them."""

from __future__ import annotations

from collections import Counter
from datetime import timedelta

from libs.contracts.base import now
from libs.contracts.relay import CAPABILITY_EPOCH_RELAYS, RelayRecord
from libs.jobs.relays import SHARE_UNITS, Home, Whereabouts, weighed
from services.placer.relays import LiveRelays

HALF = SHARE_UNITS // 2  # one member of a gang of 2
US_EAST = Whereabouts("us-east-1", "us")
US_WEST = Whereabouts("us-west-2", "us")
EU = Whereabouts("eu-west-1", "eu")


def anywhere(members: int) -> list[Whereabouts]:
    """Members in a region no relay serves: only load decides."""
    return [Whereabouts("ap-south-1", "ap")] * members


def relays(
    *names: str,
    stale: tuple[str, ...] = (),
    old: tuple[str, ...] = (),
    silent_for: float = 60.0,
    regions: dict[str, str] | None = None,
    hosts: dict[str, str] | None = None,
) -> LiveRelays:
    live = LiveRelays()
    t = now()
    for name in names:
        live.set(
            name,
            RelayRecord(
                name=name,
                region=(regions or {}).get(name, "eu-central"),
                address=f"{(hosts or {}).get(name, '127.0.0.1')}:4430",
                public_key="",
                version="test",
                capabilities=["relay-v1"] + ([] if name in old else [CAPABILITY_EPOCH_RELAYS]),
                heartbeat_time=t - timedelta(seconds=silent_for if name in stale else 1),
            ),
        )
    return live


def in_regions(regions: dict[str, str]) -> LiveRelays:
    """Live relays by name, each of its region."""
    return relays(*regions, regions=regions)


def test_gangs_spread_over_every_live_relay() -> None:
    live = relays("relay-0", "relay-1", "relay-2", "relay-3")
    load: Counter[Home] = Counter()
    pairs = []
    for _ in range(8):  # 8 gangs of 2, placed one after the other
        choice = live.choose(anywhere(2), load, named=True, t=now())
        assert sorted(choice.slots) == [0, 1]  # one member on each of the gang's two
        load.update(weighed(choice.homes))
        pairs.append(choice.relays)
    assert load == {f"relay-{i}": 4 * HALF for i in range(4)}  # 4 members each
    assert pairs[:2] == [["relay-0", "relay-1"], ["relay-2", "relay-3"]]


def test_a_gang_gets_the_least_loaded_pair_and_its_members_split_evenly() -> None:
    live = relays("relay-a", "relay-b", "relay-c")
    choice = live.choose(anywhere(5), Counter({"relay-a": 6, "relay-b": 1}), named=True, t=now())
    assert choice.relays == ["relay-b", "relay-c"]
    assert Counter(choice.homes) == {"relay-c": 3, "relay-b": 2}


def test_a_relay_whose_heartbeat_stopped_is_not_given() -> None:
    live = relays("relay-0", "relay-1", "relay-2", stale=("relay-0",))
    choice = live.choose(anywhere(2), Counter(), named=True, t=now())
    assert choice.relays == ["relay-1", "relay-2"]


def test_without_named_relays_members_use_the_first_two_counted_with_every_gang() -> None:
    # An agent that does not read named relays: slots into the first two live by name. Gangs
    # with named relays on those two count against them, and the other way round.
    live = relays("relay-0", "relay-1", "relay-2")
    choice = live.choose(anywhere(3), Counter({"relay-0": HALF}), named=False, t=now())
    assert choice.relays == [] and choice.slots == [1, 1, 0]
    assert choice.homes == [1, 1, 0]
    named = live.choose(anywhere(2), Counter({0: 1, 1: 4}), named=True, t=now())
    assert named.relays == ["relay-0", "relay-2"]


def test_one_live_relay_that_reads_no_names_keeps_every_gang_on_the_first_two() -> None:
    live = relays("relay-0", "relay-1", "relay-2", old=("relay-1",))
    assert live.choose(anywhere(2), Counter(), named=True, t=now()).relays == []
    assert relays("relay-0").choose(anywhere(2), Counter(), named=True, t=now()).relays == []


def test_while_one_relay_is_down_a_gang_gets_it_as_failover_homed_on_the_live_one() -> None:
    # relay-0 restarting (silent for a minute): a gang placed now still gets two relays, and
    # its tunnels fail over to relay-0 once it is back.
    live = relays("relay-0", "relay-1", stale=("relay-0",))
    choice = live.choose(anywhere(3), Counter(), named=True, t=now())
    assert choice.relays == ["relay-0", "relay-1"]
    assert choice.homes == ["relay-1"] * 3 and choice.slots == [1, 1, 1]
    # One silent for longer than a restart takes (retired) is not dialled for nothing.
    gone = relays("relay-0", "relay-1", stale=("relay-0",), silent_for=3600.0)
    assert gone.choose(anywhere(2), Counter(), named=True, t=now()).relays == []


def test_a_gang_gets_relays_of_its_region_even_when_others_are_less_loaded() -> None:
    live = in_regions(
        {"relay-a": "us-east-1", "relay-b": "us-east-1", "relay-c": "eu", "relay-d": "eu"}
    )
    busy: Counter[Home] = Counter({"relay-a": 6, "relay-b": 4})
    east = live.choose([US_EAST] * 3, busy, named=True, t=now())
    assert east.relays == ["relay-a", "relay-b"]
    assert Counter(east.homes) == {"relay-b": 2, "relay-a": 1}  # fewer members on relay-b
    assert live.choose([EU] * 2, busy, named=True, t=now()).relays == ["relay-c", "relay-d"]


def test_a_relay_of_the_region_class_serves_members_whose_region_has_none() -> None:
    live = in_regions({"relay-a": "us", "relay-b": "eu", "relay-c": "us-east-1"})
    # us-west-2 has no relay: the region class's are nearer than Europe's, relay-c's region
    # too once the fleet says its machines are of class us.
    west = live.choose([US_WEST] * 2, Counter(), named=True, t=now())
    assert west.relays == ["relay-a", "relay-b"] and west.homes == ["relay-a", "relay-a"]
    classes = {"us-east-1": "us"}
    west = live.choose([US_WEST] * 2, Counter(), named=True, t=now(), classes=classes)
    assert west.relays == ["relay-a", "relay-c"] and Counter(west.homes) == {
        "relay-a": 1,
        "relay-c": 1,
    }
    # us-east-1 has its own: that first, the region class's as its failover.
    east = live.choose([US_EAST] * 2, Counter(), named=True, t=now())
    assert east.relays == ["relay-a", "relay-c"] and east.homes == ["relay-c", "relay-c"]


def test_a_relay_with_few_members_of_small_gangs_is_more_loaded_than_one_with_many_of_large() -> (
    None
):
    # relay-a: two members of a gang of 2 (1 Gbit/s of cap); relay-b: four of a gang of 8
    # (half that). The next gang homes more on relay-b, though it has more members.
    live = relays("relay-a", "relay-b")
    load = weighed(["relay-a", "relay-a"]) + weighed(["relay-b"] * 4 + ["relay-c"] * 4)
    choice = live.choose(anywhere(4), load, named=True, t=now())
    assert Counter(choice.homes) == {"relay-b": 3, "relay-a": 1}


def test_a_gang_across_regions_gets_a_relay_in_each_and_each_member_homes_in_its_own() -> None:
    live = in_regions({"relay-a": "us", "relay-b": "us", "relay-c": "eu", "relay-d": "eu"})
    choice = live.choose([US_EAST, EU, US_WEST, EU], Counter(), named=True, t=now())
    assert choice.relays == ["relay-a", "relay-c"]
    assert choice.homes == ["relay-a", "relay-c", "relay-a", "relay-c"]


def test_a_direct_gangs_fallback_pair_is_of_its_region_and_homes_no_one() -> None:
    live = relays("relay-a", "relay-b", "relay-c", regions={"relay-c": "us", "relay-b": "us"})
    choice = live.choose([US_EAST] * 2, Counter(), named=True, t=now(), home=False)
    assert choice.relays == ["relay-b", "relay-c"] and choice.homes == [] == choice.slots


def test_a_relay_whose_region_no_machine_has_is_near_no_machine() -> None:
    live = in_regions({"relay-a": "us", "relay-b": "us-east-1", "relay-c": "us-eats-1"})
    classes = {"us-east-1": "us", "eu-west-1": "eu"}
    assert [r.name for r in live.near_no_machine(classes, now())] == ["relay-c"]
    assert live.near_no_machine({}, now()) == []  # no machine registered yet: nothing to say


def test_a_gangs_failover_relay_is_on_another_host_when_one_is_as_near() -> None:
    # Two relays on one host (one per core, sharing its 443) and one on another: a gang given
    # both of the first host's would lose both with it. Among relays as near, the failover
    # is on another host even when more loaded; a nearer one on the same host still wins.
    hosts = {"relay-a1": "198.18.0.1", "relay-a2": "198.18.0.1", "relay-b1": "198.18.0.2"}
    live = relays(*hosts, hosts=hosts)
    load: Counter[Home] = Counter({"relay-b1": HALF})
    choice = live.choose(anywhere(2), load, named=True, t=now())
    assert choice.relays == ["relay-a1", "relay-b1"]
    near_ones = relays(*hosts, hosts=hosts, regions={"relay-a1": "eu-west-1", "relay-a2": "eu"})
    choice = near_ones.choose([EU, EU], Counter(), named=True, t=now())
    assert choice.relays == ["relay-a1", "relay-a2"]  # relay-b1 is far from eu-west-1

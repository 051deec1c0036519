"""The placer's job cache keeps the load of active Relayed gangs on each relay (by name, or by
slot for a gang placed without named relays): each member homed there adds its share of its
gang's cap (G18), so that the next Relayed gang gets the least loaded relays."""

from __future__ import annotations

from libs.contracts.jobs import Phase
from libs.jobs.relays import SHARE_UNITS
from services.placer.jobcache import JobCache
from tests.factories import relayed

THIRD, WHOLE = SHARE_UNITS // 3, SHARE_UNITS  # a member of a gang of 3; a gang of 1


def test_loads_follow_each_gangs_newest_version() -> None:
    cache = JobCache()
    cache.saw(relayed("a", Phase.RUNNING, [0, 1, 0], 1))
    cache.saw(relayed("b", Phase.PLACED, [1], 2))
    assert loads(cache) == {0: 2 * THIRD, 1: THIRD + WHOLE}
    assert loads(cache, leaving_out="acme.a") == {1: WHOLE}
    # An older version seen late changes nothing; a newer one replaces the gang's members.
    assert not cache.saw(relayed("a", Phase.PLACED, [1, 1, 1], 0))
    assert loads(cache) == {0: 2 * THIRD, 1: THIRD + WHOLE}
    cache.saw(relayed("a", Phase.SUCCEEDED, [0, 1, 0], 3))
    assert loads(cache) == {1: WHOLE}
    cache.forget("acme.b")
    assert loads(cache) == {}


def test_a_gang_with_named_relays_loads_those_relays() -> None:
    cache = JobCache()
    cache.saw(relayed("a", Phase.RUNNING, [0, 1, 1], 1, relays=["relay-2", "relay-5"]))
    cache.saw(relayed("b", Phase.RUNNING, [0], 2))  # placed without names: slot 0
    assert loads(cache) == {"relay-2": THIRD, "relay-5": 2 * THIRD, 0: WHOLE}
    cache.saw(relayed("a", Phase.FAILED, [0, 1, 1], 3, relays=["relay-2", "relay-5"]))
    assert loads(cache) == {0: WHOLE}


def test_a_member_of_a_small_gang_weighs_more_than_one_of_a_large_gang() -> None:
    # Two members of a gang of 2 may send 1 Gbit/s; four of a gang of 8, half that.
    cache = JobCache()
    cache.saw(relayed("pair", Phase.RUNNING, [0, 0], 1, relays=["relay-a", "relay-b"]))
    cache.saw(relayed("eight", Phase.RUNNING, [0, 1] * 4, 2, relays=["relay-b", "relay-c"]))
    assert loads(cache) == {"relay-a": WHOLE, "relay-b": WHOLE // 2, "relay-c": WHOLE // 2}


def loads(cache: JobCache, leaving_out: str = "") -> dict[object, int]:
    return {k: v for k, v in cache.relay_load(leaving_out).items() if v}

"""The placer's job cache counts the members of active Relayed gangs on each relay (by name, or
by slot for a gang placed without named relays), so that the next Relayed gang gets the least
loaded relays."""

from __future__ import annotations

from libs.contracts.jobs import Phase
from services.placer.jobcache import JobCache
from tests.factories import relayed


def test_counts_follow_each_gangs_newest_version() -> None:
    cache = JobCache()
    cache.saw(relayed("a", Phase.RUNNING, [0, 1, 0], 1))
    cache.saw(relayed("b", Phase.PLACED, [1], 2))
    assert counts(cache) == {0: 2, 1: 2}
    assert counts(cache, leaving_out="acme.a") == {1: 1}
    # An older version seen late changes nothing; a newer one replaces the gang's members.
    assert not cache.saw(relayed("a", Phase.PLACED, [1, 1, 1], 0))
    assert counts(cache) == {0: 2, 1: 2}
    cache.saw(relayed("a", Phase.SUCCEEDED, [0, 1, 0], 3))
    assert counts(cache) == {1: 1}
    cache.forget("acme.b")
    assert counts(cache) == {}


def test_a_gang_with_named_relays_counts_on_those_relays() -> None:
    cache = JobCache()
    cache.saw(relayed("a", Phase.RUNNING, [0, 1, 1], 1, relays=["relay-2", "relay-5"]))
    cache.saw(relayed("b", Phase.RUNNING, [0], 2))  # placed without names: slot 0
    assert counts(cache) == {"relay-2": 1, "relay-5": 2, 0: 1}
    cache.saw(relayed("a", Phase.FAILED, [0, 1, 1], 3, relays=["relay-2", "relay-5"]))
    assert counts(cache) == {0: 1}


def counts(cache: JobCache, leaving_out: str = "") -> dict[object, int]:
    return {k: v for k, v in cache.relayed_members(leaving_out).items() if v}

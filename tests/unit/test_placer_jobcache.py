"""The placer's job cache counts the members of active Relayed gangs on each relay slot, so
that the next Relayed gang homes its members on the less loaded relay."""

from __future__ import annotations

import msgspec

from libs.bus import Versioned
from libs.contracts.jobs import GangMember, GangStatus, Job, PathClass, Phase
from services.placer.jobcache import JobCache
from tests.factories import job


def relayed(name: str, phase: Phase, slots: list[int], revision: int) -> Versioned[Job]:
    base = job(name)
    members = [
        GangMember(rank=i, node=f"{name}-{i}", address="", relay_slot=s)
        for i, s in enumerate(slots)
    ]
    status = msgspec.structs.replace(
        base.status, phase=phase, epoch=1, gang=GangStatus(PathClass.RELAYED, members)
    )
    return Versioned(base.key, msgspec.structs.replace(base, status=status), revision)


def test_counts_follow_each_gangs_newest_version() -> None:
    cache = JobCache()
    cache.saw(relayed("a", Phase.RUNNING, [0, 1, 0], 1))
    cache.saw(relayed("b", Phase.PLACED, [1], 2))
    assert cache.relayed_members() == [2, 2]
    assert cache.relayed_members(leaving_out="acme.a") == [0, 1]
    # An older version seen late changes nothing; a newer one replaces the gang's members.
    assert not cache.saw(relayed("a", Phase.PLACED, [1, 1, 1], 0))
    assert cache.relayed_members() == [2, 2]
    cache.saw(relayed("a", Phase.SUCCEEDED, [0, 1, 0], 3))
    assert cache.relayed_members() == [0, 1]
    cache.forget("acme.b")
    assert cache.relayed_members() == [0, 0]

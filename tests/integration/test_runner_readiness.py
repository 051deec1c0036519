"""The probe waits for its members' joins within the readiness window, and no longer: a member
that joined is seen at once, one that never joins ends the wait at the window (chaos seed 1:
a watch lost with a server saw no join, and the probe waited for ever)."""

from __future__ import annotations

import asyncio

from libs.bus import Bus
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.relay import Member
from services.runner.service import Runner


def _member(node: str, rank: int) -> Member:
    return Member(
        gang="acme.ready",
        epoch=1,
        node=node,
        rank=rank,
        address=f"198.18.9.{rank + 1}",
        wg_public_key="x" * 44,
        joined_time=now(),
    )


async def test_the_wait_for_joins_ends_when_they_are_in_or_at_the_window(bus: Bus) -> None:
    members = bus.bucket(names.BUCKET_MEMBERS, Member)
    patient = Runner(bus, "runner-test", readiness_seconds=30.0)
    loop = asyncio.get_running_loop()
    await members.put("acme.ready.1.a", _member("a", 0))

    async def join_b_later() -> None:
        await asyncio.sleep(0.5)
        await members.put("acme.ready.1.b", _member("b", 1))

    started = loop.time()
    await asyncio.gather(patient._wait_joined("acme.ready", 1, ["a", "b"]), join_b_later())
    assert loop.time() - started < 15.0  # b's join seen, not the 30-s window waited out

    brief = Runner(bus, "runner-test", readiness_seconds=1.5)
    started = loop.time()
    await asyncio.wait_for(brief._wait_joined("acme.ready", 1, ["a", "b", "never"]), 15.0)
    assert loop.time() - started >= 1.4  # the window, then on

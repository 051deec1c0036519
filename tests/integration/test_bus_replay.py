"""A replay reads every message of a stream once, in order, even when the consumer reading it
hands one twice and passes another by (what an ordered consumer resetting during a failover
did in chaos seed 276742: an event in all three replicas was missing from the read)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from libs.bus import Bus


class Count(msgspec.Struct):
    n: int


class Faulty:
    """The first subscription's reader: hands the second message twice, skips the fifth."""

    def __init__(self, sub: Any) -> None:
        self.sub = sub
        self.handed = 0
        self.repeat: Any = None

    async def next_msg(self, timeout: float) -> Any:
        if self.repeat is not None:
            msg, self.repeat = self.repeat, None
            return msg
        msg = await self.sub.next_msg(timeout=timeout)
        self.handed += 1
        if self.handed == 2:
            self.repeat = msg
        if self.handed == 5:
            msg = await self.sub.next_msg(timeout=timeout)
        return msg

    async def unsubscribe(self) -> None:
        await self.sub.unsubscribe()


async def test_a_read_that_doubles_one_message_and_misses_another_is_made_whole(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    await bus.ensure_stream("REPLAY", ["replay.>"])
    for n in range(10):
        await bus.publish(f"replay.{n}", Count(n))
    subscribe = bus.js.subscribe
    made: list[Any] = []

    async def first_one_faulty(*args: Any, **kwargs: Any) -> Any:
        sub = await subscribe(*args, **kwargs)
        made.append(sub)
        return Faulty(sub) if len(made) == 1 else sub

    monkeypatch.setattr(bus.js, "subscribe", first_one_faulty)
    replayed = await bus.replay("REPLAY", "replay.>")
    assert [msgspec.json.decode(m.data, type=Count).n for m in replayed] == list(range(10))
    assert len(made) == 2  # the short read was made again

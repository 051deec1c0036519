"""An apply made while no placer answers (one replica restarting while the other reconnects
after losing its server), or taken by a placer that died before answering, waits for one
rather than failing (chaos seed 552850, twice)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from libs.bus import Bus
from libs.client.client import Client
from libs.contracts import names
from libs.contracts.api import ApplyReply
from libs.contracts.base import encode
from libs.contracts.errors import ErrorCode, NodusError
from tests.conftest import StartPlacer
from tests.factories import job


async def test_an_apply_made_while_no_placer_answers_is_taken_by_the_next_one(
    bus: Bus, start_placer: StartPlacer
) -> None:
    applying = asyncio.create_task(Client(bus).apply(job("waits")))
    await asyncio.sleep(1.0)
    assert not applying.done()  # no placer yet: it is asked again
    await start_placer()
    # The placer's own answer (this fleet has no machine), not "nobody answers".
    with pytest.raises(NodusError) as answered:
        await asyncio.wait_for(applying, 15)
    assert answered.value.code is ErrorCode.UNSATISFIABLE, answered.value


async def test_an_apply_whose_placer_died_before_answering_is_asked_again(bus: Bus) -> None:
    """The first placer to take the request dies with it; the next one answers."""
    taken: list[int] = []

    async def placer_that_dies_with_the_first(msg: Any) -> None:
        taken.append(len(taken))
        if len(taken) > 1:
            await msg.respond(encode(ApplyReply(job=job("waits"), created=True)))

    await bus.nc.subscribe(names.API_JOBS_APPLY, cb=placer_that_dies_with_the_first)
    reply = await asyncio.wait_for(Client(bus).apply(job("waits"), timeout=1.0), 15)
    assert reply.created and len(taken) == 2


async def test_an_apply_nobody_ever_answers_ends_at_its_patience(bus: Bus) -> None:
    started = asyncio.get_running_loop().time()
    with pytest.raises(NodusError) as unanswered:
        await Client(bus).apply(job("waits"), timeout=1.0, patience=2.0)
    assert unanswered.value.code is ErrorCode.NO_RESPONDERS
    assert asyncio.get_running_loop().time() - started < 10

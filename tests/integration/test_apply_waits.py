"""An apply made while no placer answers (one replica restarting while the other reconnects
after losing its server) waits for one rather than failing at once (chaos seed 552850)."""

from __future__ import annotations

import asyncio

import pytest

from libs.bus import Bus
from libs.client.client import Client
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

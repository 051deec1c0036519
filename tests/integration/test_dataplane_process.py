"""The dataplane process's own life, on a real bus: how it ends when its epoch ends first."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from libs.bus import Bus
from libs.contracts import names
from libs.contracts.epochs import JoinKeyGrant
from services.agent.dataplane.process import DataplaneProcess
from services.agent.dataplane.store import EpochStore
from tests.unit.test_dataplane_state import _state


class _SlowStart:
    """A dataplane whose start is still reading the bus when the epoch ends."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.ready = False
        self.unwound_on_open_bus = False

    async def start(self) -> None:
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(0.2)  # a watcher's stop: a round trip on the bus
            self.unwound_on_open_bus = not self.bus.nc.is_closed and not self.bus.nc.is_draining

    async def stop(self) -> None:
        pass


async def test_a_dataplane_whose_epoch_ends_while_it_starts_unwinds_the_start_before_it_returns(
    tmp_path: Path, bus: Bus
) -> None:
    # The join key is deleted: the process hears at once that its epoch is over, while its
    # start still waits (chaos seed 1: the start's read of the relays then met a closing bus).
    key = "vast-a.acme.rl.1"
    await bus.bucket(names.BUCKET_JOINKEYS, JoinKeyGrant).delete(key)
    store = EpochStore(tmp_path)
    store.save(_state(key), os.urandom(32))
    process = DataplaneProcess(store.directory(key), bus)
    slow = _SlowStart(bus)
    process.dataplane = slow  # type: ignore[assignment]
    assert await asyncio.wait_for(process.run(), 10) == 0
    assert slow.unwound_on_open_bus

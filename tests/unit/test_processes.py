"""A daemon's child processes are never left behind: a command that hangs past its time is
killed and reaped, and so is one whose caller is cancelled (its daemon stopping)."""

from __future__ import annotations

import asyncio

import pytest

from libs.contracts.errors import NodusError
from libs.runtime.processes import reaped
from services.agent.direct import nodus0
from tests.conftest import children, left_when_cancelled


async def test_a_device_command_that_hangs_is_a_clear_error_and_is_killed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # `wg` or `ip` stuck (a wireguard-go that stopped answering its socket): before, the
    # agent got a bare TimeoutError and the command ran on.
    monkeypatch.setattr(nodus0, "UAPI_TIMEOUT", 0.2)
    before = children()
    with pytest.raises(NodusError, match=r"nodus0: sleep 30 did not answer in 0.2 s \(killed\)"):
        await nodus0._run("sleep", "30")
    assert children() - before == set()


async def test_a_caller_cancelled_leaves_no_process_behind() -> None:
    async def run() -> None:
        process = await asyncio.create_subprocess_exec("sleep", "30")
        async with reaped(process):
            await process.wait()

    assert await left_when_cancelled(run()) == set()

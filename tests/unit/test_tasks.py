"""A service's background tasks: a crash is logged, not lost; close stops every one."""

from __future__ import annotations

import asyncio
import logging

import pytest

from libs.runtime.tasks import TaskSet


async def test_a_crashed_task_is_logged_with_its_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tasks = TaskSet("relay")

    async def crash() -> None:
        raise ValueError("bad frame")

    with caplog.at_level(logging.ERROR):
        await asyncio.gather(tasks.spawn(crash(), name="session-7"), return_exceptions=True)
        await asyncio.sleep(0)
    assert len(tasks) == 0
    [record] = [r for r in caplog.records if "session-7" in r.getMessage()]
    assert record.levelno == logging.ERROR
    assert record.exc_info is not None and "bad frame" in str(record.exc_info[1])


async def test_close_cancels_and_awaits_every_task(caplog: pytest.LogCaptureFixture) -> None:
    tasks = TaskSet("agent")
    stopped: list[int] = []

    async def forever(n: int) -> None:
        try:
            await asyncio.sleep(3600)
        finally:
            stopped.append(n)

    running = [tasks.spawn(forever(n)) for n in range(3)]
    await asyncio.sleep(0)
    await tasks.close()
    assert sorted(stopped) == [0, 1, 2]
    assert all(task.cancelled() for task in running)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # cancelling is no crash

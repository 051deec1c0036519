"""Stopping background tasks reliably."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable


async def cancel_and_wait(
    tasks: Iterable[asyncio.Task[object]] | Iterable[asyncio.Task[None]],
) -> None:
    """Cancel until every task is done: on Python 3.11, `asyncio.wait_for` inside a library can
    swallow a cancellation that lands as its inner future completes, so one cancel may be lost."""
    pending = {task for task in tasks if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.2)

"""Background tasks: held, logged when they crash, stopped reliably."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Iterable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")


async def cancel_and_wait(
    tasks: Iterable[asyncio.Task[Any]],
) -> None:
    """Cancel until every task is done: on Python 3.11, `asyncio.wait_for` inside a library can
    swallow a cancellation that lands as its inner future completes, so one cancel may be lost."""
    pending = {task for task in tasks if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=0.2)


class TaskSet:
    """Tasks a service starts and forgets: held until they end (the loop keeps only weak
    references), a crash logged with its traceback at error level instead of vanishing with
    the task, and all of them cancelled and awaited on `close`."""

    def __init__(self, name: str, log: logging.Logger | None = None) -> None:
        self.name = name
        self._log = log or logging.getLogger("nodus.tasks")
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, work: Coroutine[Any, Any, T], name: str | None = None) -> asyncio.Task[T]:
        task = asyncio.get_running_loop().create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            error = task.exception()
            self._log.error("%s task %s crashed", self.name, task.get_name(), exc_info=error)

    def __len__(self) -> int:
        return len(self._tasks)

    def __iter__(self) -> Iterator[asyncio.Task[Any]]:
        return iter(list(self._tasks))

    async def close(self) -> None:
        await cancel_and_wait(list(self._tasks))


ConnectionHandler = Callable[
    [asyncio.StreamReader, asyncio.StreamWriter], Coroutine[Any, Any, None]
]


def handled_by(
    tasks: TaskSet, handler: ConnectionHandler
) -> Callable[[asyncio.StreamReader, asyncio.StreamWriter], asyncio.Task[None]]:
    """The callback to give `asyncio.start_server`: each connection's handler runs in `tasks`.

    Handed a coroutine function, Python 3.11's stream protocol owns the task and, when it is
    cancelled (a server stopped, the loop shutting down), logs "Exception in callback ...
    CancelledError" at error level; handed a task, it stays out of the way."""
    return lambda reader, writer: tasks.spawn(handler(reader, writer))

"""Keys waiting to be worked on, and the workers that work on them, as a Kubernetes
controller's work queue: a key is queued once however often it is marked, one worker at a time
has it, and a key marked while it is being worked on is worked on again right after. The
remediator reconciles nodes with it; the placer places jobs."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from libs.runtime.tasks import TaskSet


class BatchWorkQueue:
    """A work queue whose workers take every key waiting (up to `batch`) at once: work that is
    cheaper together (the placer plans a batch of jobs against one view and writes their
    records in one round trip per step). The same rules per key: queued once, one worker at a
    time has it, marked while worked on means worked on again right after."""

    def __init__(
        self,
        work: Callable[[list[str]], Awaitable[None]],
        workers: int,
        batch: int,
        log: logging.Logger,
    ) -> None:
        self._work = work
        self._log = log
        self._workers = workers
        self._batch = batch
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._queued: set[str] = set()
        self._running: set[str] = set()
        self._rerun: set[str] = set()
        self._tasks = TaskSet(f"{log.name} workers", log)

    @property
    def idle(self) -> bool:
        """No key waits and none is being worked on."""
        return not self._queued and not self._running

    def working_on(self, key: str) -> bool:
        return key in self._running

    def mark(self, key: str) -> None:
        if key in self._running:
            self._rerun.add(key)
        elif key not in self._queued:
            self._queued.add(key)
            self._queue.put_nowait(key)

    def start(self) -> None:
        for index in range(self._workers):
            self._tasks.spawn(self._worker(), name=f"worker {index}")

    async def stop(self) -> None:
        await self._tasks.close()

    async def _worker(self) -> None:
        while True:
            keys = [await self._queue.get()]
            while len(keys) < self._batch and not self._queue.empty():
                keys.append(self._queue.get_nowait())
            self._queued.difference_update(keys)
            self._running.update(keys)
            try:
                await self._work(keys)
            except asyncio.CancelledError:
                raise
            except Exception:
                self._log.exception(
                    "working on %s failed; the next mark tries again", ", ".join(keys)
                )
            finally:
                self._running.difference_update(keys)
                for key in keys:
                    if key in self._rerun:
                        self._rerun.discard(key)
                        self.mark(key)


class WorkQueue(BatchWorkQueue):
    """One key at a time (a BatchWorkQueue of batches of one)."""

    def __init__(
        self, work: Callable[[str], Awaitable[None]], workers: int, log: logging.Logger
    ) -> None:
        async def one(keys: list[str]) -> None:
            await work(keys[0])

        super().__init__(one, workers, 1, log)

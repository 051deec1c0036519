"""The nodes waiting to be reconciled, and the workers that reconcile them, as a Kubernetes
controller's work queue: a node is queued once however often it is marked, one worker at a time
has it, and a node marked while it is being reconciled is reconciled again right after."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from libs.runtime.tasks import TaskSet

log = logging.getLogger("nodus.remediator")


class WorkQueue:
    def __init__(self, work: Callable[[str], Awaitable[None]], workers: int) -> None:
        self._work = work
        self._workers = workers
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._queued: set[str] = set()
        self._running: set[str] = set()
        self._rerun: set[str] = set()
        self._tasks = TaskSet("remediator workers", log)

    @property
    def idle(self) -> bool:
        """No node waits and none is being reconciled."""
        return not self._queued and not self._running

    def mark(self, node: str) -> None:
        if node in self._running:
            self._rerun.add(node)
        elif node not in self._queued:
            self._queued.add(node)
            self._queue.put_nowait(node)

    def start(self) -> None:
        for index in range(self._workers):
            self._tasks.spawn(self._worker(), name=f"worker {index}")

    async def stop(self) -> None:
        await self._tasks.close()

    async def _worker(self) -> None:
        while True:
            node = await self._queue.get()
            self._queued.discard(node)
            self._running.add(node)
            try:
                await self._work(node)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reconciling %s failed; the next tick tries again", node)
            finally:
                self._running.discard(node)
                if node in self._rerun:
                    self._rerun.discard(node)
                    self.mark(node)

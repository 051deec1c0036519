"""One detector source read on a thread of its own, each read awaited for a bounded time.

A read that blocks (a kernel log opened the wrong way, a dcgm-exporter that accepts and never
answers, an NFS mount that hangs a sysfs-like tree) holds only its own thread: the caller gets
`Overrun` after `bound` seconds and goes on with the other sources. While that read is still
running the source is not read again (two reads of one source would race on its detector's
state); each later call reports `Overrun` at once until the stuck read returns, and the next
call after that gets what the late read found (the freshest there is) instead of a new read.

Threads are daemon threads: a read stuck for good never stops the process from exiting."""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")

_Job = tuple[Callable[[], Any], asyncio.AbstractEventLoop, "asyncio.Future[Any]"]


class Overrun(Exception):
    """The source did not answer within its bound (or is still busy with an earlier read)."""

    def __init__(self, busy_for: float) -> None:
        super().__init__(f"still reading after {busy_for:.1f}s")
        self.busy_for = busy_for


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # the caller stopped waiting (cancelled)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class SourceReader(Generic[T]):
    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._busy: asyncio.Future[Any] | None = None
        self._busy_since = 0.0
        self._late = False  # _busy overran: its result is the next call's

    @property
    def busy(self) -> bool:
        return self._busy is not None and not self._busy.done()

    async def read(self, work: Callable[[], T], bound: float) -> T:
        """`work()` on this source's thread; raises Overrun after `bound` seconds."""
        if self.busy:
            raise Overrun(time.monotonic() - self._busy_since)
        if self._late and self._busy is not None:
            late, self._late = self._busy, False
            if not late.cancelled():
                return late.result()  # type: ignore[no-any-return]
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        future.add_done_callback(_retrieve)  # an overrun read's late error is not "unretrieved"
        self._busy, self._busy_since = future, time.monotonic()
        self._jobs.put((work, loop, future))
        try:
            return await asyncio.wait_for(asyncio.shield(future), bound)
        except TimeoutError:
            self._late = True
            raise Overrun(time.monotonic() - self._busy_since) from None

    def close(self) -> None:
        """The thread ends after its current read (if it ever returns)."""
        if self._thread is not None:
            self._jobs.put(None)
            self._thread = None

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            work, loop, future = job
            result: Any = None
            error: BaseException | None = None
            try:
                result = work()
            except BaseException as caught:  # handed to the awaiting task, which logs it
                error = caught
            try:
                loop.call_soon_threadsafe(_settle, future, result, error)
            except RuntimeError:
                return  # the loop is closed: nobody is waiting any more

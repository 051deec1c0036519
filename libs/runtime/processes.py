"""Child processes an asyncio daemon runs (ip, wg, nft, a probe, a check): never left behind."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable


@contextlib.asynccontextmanager
async def reaped(
    process: asyncio.subprocess.Process, kill: Callable[[], None] | None = None
) -> AsyncIterator[asyncio.subprocess.Process]:
    """Whatever ends the block (its end, a timeout, the caller cancelled as its daemon stops),
    a process still running is killed (`kill`: a whole process group, say) and waited for, so
    none is orphaned, and none is reaped after the loop closed."""
    try:
        yield process
    finally:
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                (kill or process.kill)()
            await asyncio.shield(process.wait())

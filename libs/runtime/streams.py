"""Closing an asyncio stream so that a peer that went away is not reported as a bug."""

from __future__ import annotations

import asyncio
import contextlib

CLOSE_SECONDS = 1.0


async def close_stream(writer: asyncio.StreamWriter | None) -> None:
    """Close `writer` and wait, briefly, until its transport is gone. A peer that went away
    mid-write (EPIPE: a dataplane stopping, wireguard-go killed) ends the transport with an
    error; waiting here retrieves it, where a bare close() left it to be logged at collection
    as "Future exception was never retrieved" (an error line in the daemon's log)."""
    if writer is None:
        return
    writer.close()
    with contextlib.suppress(Exception):  # the error is the peer's going: nothing to say
        await asyncio.wait_for(writer.wait_closed(), CLOSE_SECONDS)

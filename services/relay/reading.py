"""How the relay reads a member's or a mesh peer's connection."""

from __future__ import annotations

from libs.relayproto import Frame, FrameError
from libs.relayproto.connection import Connection
from services.relay.metrics import DROPPED


async def read_frames(conn: Connection) -> list[Frame] | None:
    """The next read's frames; None once the connection is closed or sent garbage (counted as
    malformed: the sender's own conduct ends its connection, nobody else's)."""
    if conn.closed:
        return None
    try:
        return await conn.read_frames()
    except FrameError:
        DROPPED.labels("malformed").inc()
        return None

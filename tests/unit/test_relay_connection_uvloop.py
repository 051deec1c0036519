"""The relay connection under uvloop, as the daemons run it: uvloop raises RuntimeError ("the
handler is closed") where asyncio's own loop stays quiet, for a transport the peer already
reset. A member's relay loop met one when a relay was killed under it (the chaos run) and its
task crashed; the framed connection must report a gone peer, never raise."""

from __future__ import annotations

import asyncio

import uvloop

from libs.relayproto.connection import Connection
from libs.relayproto.frames import Ping


async def _reset_pair() -> tuple[asyncio.StreamReader, asyncio.StreamWriter, asyncio.Server]:
    """A client connection whose transport the loop has already closed (a reset seen)."""

    async def handle(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.transport.abort()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.transport.abort()
    await asyncio.sleep(0.05)
    return reader, writer, server


def test_a_connection_reset_before_it_was_framed_reports_closed_and_never_raises() -> None:
    async def main() -> None:
        reader, writer, server = await _reset_pair()
        try:
            conn = Connection(reader, writer)
            assert conn.closed
            assert conn.send_nowait(Ping(b"12345678")) is False
            assert conn.backlog == 0
            await conn.drain()
            conn.close()
            conn.abort()
        finally:
            server.close()
            await server.wait_closed()

    uvloop.run(main())

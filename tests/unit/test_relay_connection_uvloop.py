"""The relay connection under uvloop, as the daemons run it: uvloop raises RuntimeError ("the
handler is closed") where asyncio's own loop stays quiet, for a transport the peer already
reset. A member's relay loop met one when a relay was killed under it (the chaos run) and its
task crashed; the framed connection must report a gone peer, never raise."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from libs.relayproto.connection import open_connection
from libs.relayproto.frames import Ping


def test_a_connection_the_peer_reset_reports_closed_and_never_raises() -> None:
    async def main() -> None:
        async def handle(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.transport.abort()

        server = await asyncio.start_server(handle, "127.0.0.1", 0)
        try:
            conn = await open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
            assert conn.transport is not None
            conn.transport.abort()
            await asyncio.sleep(0.05)
            assert conn.closed
            assert conn.send_nowait(Ping(b"12345678")) is False
            assert conn.backlog == 0
            await conn.drain()
            with pytest.raises(ConnectionError):
                await conn.read_frames()
            conn.close()
            conn.abort()
        finally:
            server.close()
            await server.wait_closed()

    uvloop.run(main())

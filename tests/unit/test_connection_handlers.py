"""A server stopped with connections open says nothing at error level (Python 3.11's stream
protocol logs "Exception in callback ... CancelledError" for a handler task it owns)."""

from __future__ import annotations

import asyncio
from typing import Any

from services.agent.probeserver import ProbeServer


async def test_a_probe_server_stopped_under_an_open_connection_logs_no_error() -> None:
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    server = ProbeServer("127.0.0.1")
    await server.start()
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"P")  # a ping stream: the handler waits for the next ping
    await writer.drain()
    await asyncio.sleep(0.1)

    await server.stop()
    await asyncio.sleep(0.1)

    assert await asyncio.wait_for(reader.read(), 5) == b"", "the stopped server closes it"
    writer.close()
    assert errors == []

"""The probe's server (`probe.py` has the protocol and the client): each member runs one on
its advertised address while its gang epoch is probed."""

from __future__ import annotations

import asyncio

from libs.runtime.streams import close_stream
from libs.runtime.tasks import TaskSet, handled_by
from services.agent.probe import CHUNK, U64


class ProbeServer:
    """Runs inside the agent on the member's own advertised address, on an ephemeral port."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.server: asyncio.Server | None = None
        self._connections = TaskSet("probe connection")

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        self.server = await asyncio.start_server(
            handled_by(self._connections, self._serve), self.address, 0
        )

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        await self._connections.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            kind = await reader.readexactly(1)
            if kind == b"R":
                writer.write(b"r")
            elif kind == b"P":
                while True:
                    try:
                        message = await reader.readexactly(8)
                    except asyncio.IncompleteReadError:
                        break
                    writer.write(message)
                    await writer.drain()
            elif kind == b"T":
                total = 0
                while data := await reader.read(CHUNK):
                    total += len(data)
                writer.write(U64.pack(total))
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            await close_stream(writer)

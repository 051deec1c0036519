"""A framed TCP connection for relays and their clients: the thin asyncio shell around the
frame codec, with write backpressure (a full peer makes its senders wait)."""

from __future__ import annotations

import asyncio

from libs.relayproto.frames import Frame, FrameDecoder, FrameError, encode

READ_SIZE = 256 * 1024
HIGH_WATER = 1 << 20  # bytes queued to one connection before its senders wait
HELLO_TIMEOUT = 5.0


class Connection:
    """One TCP connection: framed writes with backpressure, framed reads."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.decoder = FrameDecoder()
        self.closed = False
        writer.transport.set_write_buffer_limits(high=HIGH_WATER)

    async def send(self, frame: Frame) -> None:
        if self.closed:
            return
        self.writer.write(encode(frame))
        if self.writer.transport.get_write_buffer_size() > HIGH_WATER:
            try:
                await self.writer.drain()
            except ConnectionError:
                self.closed = True

    async def read_frames(self) -> list[Frame]:
        data = await self.reader.read(READ_SIZE)
        if not data:
            raise ConnectionResetError("closed by peer")
        return self.decoder.feed(data)

    async def first_frame(self) -> Frame:
        while True:
            frames = await asyncio.wait_for(self.read_frames(), HELLO_TIMEOUT)
            if frames:
                if len(frames) > 1:
                    raise FrameError("frames before the handshake finished")
                return frames[0]

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.writer.close()

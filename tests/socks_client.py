"""A SOCKS5 client for tests: connect through an endpoint, get the reply code and the streams."""

from __future__ import annotations

import asyncio

from libs.socks5 import client_connect, client_greeting, parse_reply


async def socks_connect(
    socks: tuple[str, int], host: str, port: int
) -> tuple[int, asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection(*socks)
    writer.write(client_greeting())
    await reader.readexactly(2)
    writer.write(client_connect(host, port))
    head = await reader.readexactly(4)
    rest = await reader.readexactly({1: 4, 4: 16}.get(head[3], 4) + 2)
    reply = parse_reply(head + rest)
    assert reply is not None
    return int(reply.code), reader, writer

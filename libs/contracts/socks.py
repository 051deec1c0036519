"""The SOCKS5 endpoint's connection events (libs/socks5/server.py), one JSON line each."""

from __future__ import annotations

import msgspec


class SocksConnected(msgspec.Struct, frozen=True, tag_field="event", tag="connected"):
    """A CONNECT was answered: reply 0 and `via` (the endpoint's side of the connection it
    made) on success, the failure code and `error` otherwise."""

    client: str
    host: str
    port: int
    reply: int
    via: str = ""
    error: str = ""


class SocksClosed(msgspec.Struct, frozen=True, tag_field="event", tag="closed"):
    """A spliced connection ended; bytes client -> destination (up) and back (down)."""

    client: str
    host: str
    port: int
    bytes_up: int
    bytes_down: int


class SocksRejected(msgspec.Struct, frozen=True, tag_field="event", tag="rejected"):
    """The client's input was refused before any dial (malformed, unsupported, too slow)."""

    client: str
    reason: str
    reply: int | None = None


SocksEvent = SocksConnected | SocksClosed | SocksRejected

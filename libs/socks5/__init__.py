"""SOCKS5 for the shim's traffic: a sans-I/O codec (`codec`, exported here) and a thin asyncio
server (`libs.socks5.server.serve(host, port, dial)`, imported from its module so the codec's
users do not pull asyncio in). `python -m libs.socks5` runs a standalone endpoint."""

from libs.socks5.codec import (
    AddressType,
    Command,
    ConnectRequest,
    Rejected,
    Reply,
    ReplyCode,
    ServerCodec,
    SocksError,
    State,
    client_connect,
    client_greeting,
    parse_method_selection,
    parse_reply,
)

__all__ = [
    "AddressType",
    "Command",
    "ConnectRequest",
    "Rejected",
    "Reply",
    "ReplyCode",
    "ServerCodec",
    "SocksError",
    "State",
    "client_connect",
    "client_greeting",
    "parse_method_selection",
    "parse_reply",
]

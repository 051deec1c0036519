"""STUN served by a relay on UDP (RFC 8489 Binding only): a member behind NAT learns the
address and port its NAT gave it (its server-reflexive candidate for ICE, G11). aioice's
codec parses and builds the messages; the rest is a few lines, answering from the same
socket the request came to, as RFC 8489 wants, so the mapping seen is the one ICE uses.
"""

from __future__ import annotations

import asyncio
import logging
from typing import cast

from aioice import stun
from prometheus_client import Counter

log = logging.getLogger("nodus.relay.stun")

STUN_REQUESTS = Counter(
    "nodus_relay_stun_requests_total",
    "STUN datagrams received on the relay's UDP port, by outcome",
    ["outcome"],
)
SOFTWARE = "nodus-relay"


def answer(data: bytes, source: tuple[str, int]) -> bytes | None:
    """The response to a Binding request from `source`; None for anything else (ignored, as
    a STUN server ignores what it does not understand)."""
    try:
        request = stun.parse_message(data)
    except ValueError:
        STUN_REQUESTS.labels("malformed").inc()
        return None
    if request.message_method != stun.Method.BINDING or request.message_class != stun.Class.REQUEST:
        STUN_REQUESTS.labels("not_binding").inc()
        return None
    response = stun.Message(
        message_method=stun.Method.BINDING,
        message_class=stun.Class.RESPONSE,
        transaction_id=request.transaction_id,
        attributes={"XOR-MAPPED-ADDRESS": (source[0], source[1]), "SOFTWARE": SOFTWARE},
    )
    response.add_fingerprint()
    STUN_REQUESTS.labels("answered").inc()
    return bytes(response)


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        reply = answer(data, addr)
        if reply is not None and self.transport is not None:
            self.transport.sendto(reply, addr)

    def error_received(self, exc: Exception) -> None:  # an ICMP error for one client: theirs
        log.debug("stun: %s", exc)


class StunServer:
    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._transport: asyncio.DatagramTransport | None = None

    async def start(self) -> None:
        transport, _ = await asyncio.get_running_loop().create_datagram_endpoint(
            # The relays of one host may answer STUN on one port: any of them answers alike.
            _Protocol,
            local_addr=(self.host, self.port),
            reuse_port=True,
        )
        self._transport = transport
        self.port = transport.get_extra_info("sockname")[1]
        log.info("STUN on udp %s:%d", self.host, self.port)

    async def stop(self) -> None:
        if self._transport is not None:
            self._transport.close()
            self._transport = None

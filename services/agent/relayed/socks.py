"""The agent's SOCKS5 entry for the shim (G14): CONNECT to a peer's advertised address becomes
a stream in the tunnel; every other destination is refused with the proper reply."""

from __future__ import annotations

import asyncio
import ipaddress
import logging

from prometheus_client import Counter

from libs.runtime.tasks import TaskSet
from libs.socks5 import AddressType, ConnectRequest, Rejected, ReplyCode, ServerCodec
from libs.socks5.server import read_request
from services.agent.relayed.tunnel import StreamRefused, Tunnel

log = logging.getLogger("nodus.agent.socks")

REQUESTS = Counter(
    "nodus_agent_socks_requests_total", "SOCKS5 requests by outcome", ["node", "outcome"]
)
HANDSHAKE_TIMEOUT = 10.0


class SocksFront:
    def __init__(self, tunnel: Tunnel, listen: tuple[str, int]) -> None:
        self.tunnel = tunnel
        self.listen = listen
        self.server: asyncio.Server | None = None
        self._clients = TaskSet("socks client", log)

    async def start(self) -> None:
        self.server = await asyncio.start_server(
            lambda reader, writer: self._clients.spawn(self._client(reader, writer)),
            *self.listen,
        )

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        await self._clients.close()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        node = self.tunnel.node
        codec = ServerCodec()
        try:
            request = await asyncio.wait_for(read_request(codec, reader, writer), HANDSHAKE_TIMEOUT)
            if isinstance(request, Rejected):
                log.info("SOCKS request refused: %s", request.reason)
            if not isinstance(request, ConnectRequest):
                REQUESTS.labels(node, "malformed").inc()
                return
            code = self._allowed(request)
            if code is not None:
                REQUESTS.labels(node, "not_a_peer").inc()
                codec.refuse(code)
                writer.write(codec.data_to_send())
                await writer.drain()
                return
            try:
                bridge = await self.tunnel.connect(request.host, request.port)
            except StreamRefused as refused:
                REQUESTS.labels(node, f"refused_{refused.code}").inc()
                codec.refuse(ReplyCode(refused.code))
                writer.write(codec.data_to_send())
                await writer.drain()
                return
            codec.accept()
            writer.write(codec.data_to_send())
            REQUESTS.labels(node, "connected").inc()
            await self.tunnel.splice(bridge, reader, writer, codec.take_early_data())
        except (TimeoutError, ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    def _allowed(self, request: ConnectRequest) -> ReplyCode | None:
        """Only IP literals of this gang epoch's other members (G14)."""
        if request.address_type is AddressType.DOMAIN:
            return ReplyCode.ADDRESS_TYPE_NOT_SUPPORTED
        host = str(ipaddress.ip_address(request.host))
        if host not in self.tunnel.peers_by_address:
            return ReplyCode.NOT_ALLOWED
        return None

"""The agent's SOCKS5 entry for the shim (G14): CONNECT to a peer's advertised address becomes
a stream in the tunnel; every other destination is refused with the proper reply."""

from __future__ import annotations

import asyncio
import ipaddress
import logging

from prometheus_client import Counter

from libs.runtime.tasks import TaskSet
from libs.socks5 import AddressType, ConnectRequest, Rejected, ReplyCode, ServerCodec
from services.agent.relayed.localstream import LocalStream
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
        self.sessions: set[SocksSession] = set()
        self.dials = TaskSet("socks connect", log)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(lambda: SocksSession(self), *self.listen)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        for session in list(self.sessions):
            session.close()
        await self.dials.close()

    def allowed(self, request: ConnectRequest) -> ReplyCode | None:
        """Only IP literals of this gang epoch's other members (G14)."""
        if request.address_type is AddressType.DOMAIN:
            return ReplyCode.ADDRESS_TYPE_NOT_SUPPORTED
        host = str(ipaddress.ip_address(request.host))
        if host not in self.tunnel.peers_by_address:
            return ReplyCode.NOT_ALLOWED
        return None


class SocksSession(LocalStream):
    """One program's connection: the SOCKS5 handshake (the sans-I/O codec), then, once the
    stream to the peer is open, the program's end of it (LocalStream)."""

    def __init__(self, front: SocksFront) -> None:
        super().__init__()
        self.front = front
        self.codec = ServerCodec()
        self._deadline: asyncio.TimerHandle | None = None
        self._dialing = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.front.sessions.add(self)
        loop = asyncio.get_running_loop()
        self._deadline = loop.call_later(HANDSHAKE_TIMEOUT, self.close)

    def data_received(self, data: bytes) -> None:
        if self.bridge is not None:
            super().data_received(data)
            return
        event = self.codec.receive_data(data)
        self._answer()
        if isinstance(event, Rejected):
            log.info("SOCKS request refused: %s", event.reason)
            REQUESTS.labels(self.front.tunnel.node, "malformed").inc()
            self.close()
        elif isinstance(event, ConnectRequest):
            self._cancel_deadline()
            self.pause_reading()  # what the program sends meanwhile waits in its socket
            self._dialing = True
            self.front.dials.spawn(self._connect(event))

    def eof_received(self) -> bool:
        if self.bridge is not None or self._dialing:
            return super().eof_received()
        REQUESTS.labels(self.front.tunnel.node, "malformed").inc()
        return False  # closed before its request

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        self.front.sessions.discard(self)
        super().connection_lost(exc)

    async def _connect(self, request: ConnectRequest) -> None:
        try:
            await self._open(request)
        finally:
            if self.bridge is None:
                self.close()  # refused, failed or stopped: the program is not left waiting

    async def _open(self, request: ConnectRequest) -> None:
        tunnel, node = self.front.tunnel, self.front.tunnel.node
        code = self.front.allowed(request)
        if code is not None:
            REQUESTS.labels(node, "not_a_peer").inc()
            self._refuse(code)
            return
        try:
            bridge = await tunnel.connect(request.host, request.port)
        except StreamRefused as refused:
            REQUESTS.labels(node, f"refused_{refused.code}").inc()
            self._refuse(ReplyCode(refused.code))
            return
        self.codec.accept()
        self._answer()
        REQUESTS.labels(node, "connected").inc()
        early = self.codec.take_early_data()
        if early:
            self.pending.appendleft(early)
        tunnel.sockets.attach(bridge, self)  # a program already gone resets the stream it opened

    def _refuse(self, code: ReplyCode) -> None:
        self.codec.refuse(code)
        self._answer()
        self.close()

    def _answer(self) -> None:
        out = self.codec.data_to_send()
        if out and not self.closing():
            assert self.transport is not None
            self.transport.write(out)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

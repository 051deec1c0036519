"""A member's connection to one relay: prove the epoch's WireGuard key, then send and receive
WireGuard messages. The tunnel keeps two of these and moves between them (G15)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from libs.contracts.errors import ErrorCode, NodusError
from libs.relayproto import (
    Challenge,
    ErrorFrame,
    Hello,
    Home,
    Ping,
    Pong,
    Recv,
    Send,
    Welcome,
    encode,
    member_proof,
)
from libs.relayproto.connection import Connection

log = logging.getLogger("nodus.agent.relay")


class RelayClient:
    def __init__(
        self,
        name: str,
        address: str,
        gang: str,
        epoch: int,
        node: str,
        wg_private: bytes,
        wg_public: bytes,
        on_message: Callable[[bytes, bytes], None],
    ) -> None:
        self.name = name
        self.address = address
        self.gang, self.epoch, self.node = gang, epoch, node
        self._private, self._public = wg_private, wg_public
        self.on_message = on_message
        self.conn: Connection | None = None
        self.region = ""
        self.rate_bps = 0

    @property
    def up(self) -> bool:
        return self.conn is not None and not self.conn.closed

    async def connect(self, timeout: float = 5.0) -> None:
        host, _, port = self.address.rpartition(":")
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host.strip("[]"), int(port)), timeout
        )
        conn = Connection(reader, writer)
        try:
            challenge = await conn.first_frame()
            if not isinstance(challenge, Challenge):
                raise NodusError(ErrorCode.INVALID, f"relay {self.name} did not challenge")
            proof = member_proof(
                self._private,
                challenge.relay_key,
                challenge.nonce,
                self.gang,
                self.epoch,
                self.node,
            )
            await conn.send(Hello(self.gang, self.epoch, self.node, self._public, proof))
            reply = await conn.first_frame()
        except BaseException:
            conn.close()
            raise
        if isinstance(reply, ErrorFrame):
            conn.close()
            raise NodusError(
                ErrorCode.CONFLICT, f"relay {self.name} refused: {reply.code}: {reply.message}"
            )
        if not isinstance(reply, Welcome):
            conn.close()
            raise NodusError(ErrorCode.INVALID, f"relay {self.name} sent {type(reply).__name__}")
        self.region, self.rate_bps = reply.region, reply.member_rate_bps
        self.conn = conn

    async def run(self) -> None:
        """Deliver what the relay sends until the connection ends (then `up` is False)."""
        conn = self.conn
        if conn is None:
            return
        try:
            while not conn.closed:
                for frame in await conn.read_frames():
                    if isinstance(frame, Recv):
                        self.on_message(frame.src, frame.message)
                    elif isinstance(frame, Ping):
                        await conn.send(Pong(frame.data))
                    elif isinstance(frame, ErrorFrame):
                        log.warning("relay %s: %s: %s", self.name, frame.code, frame.message)
                        conn.close()
        except (ConnectionError, OSError, asyncio.IncompleteReadError) as error:
            log.info("relay %s connection ended: %s", self.name, error)
        finally:
            conn.close()

    def send_now(self, dst: bytes, message: bytes) -> bool:
        """Queue a WireGuard message without waiting; False when this relay is down."""
        conn = self.conn
        if conn is None or conn.closed or conn.writer.transport.is_closing():
            return False  # a dead relay: the link resends what it did not acknowledge
        try:
            conn.writer.write(encode(Send(dst, message)))
        except RuntimeError:  # the transport closed under us (the relay died just now)
            conn.closed = True
            return False
        return True

    def backlog(self) -> int:
        conn = self.conn
        return conn.writer.transport.get_write_buffer_size() if conn and not conn.closed else 0

    async def drain(self) -> None:
        conn = self.conn
        if conn is not None and not conn.closed:
            try:
                await conn.writer.drain()
            except ConnectionError:
                conn.close()

    async def home(self, failover: bool) -> None:
        if self.conn is not None:
            await self.conn.send(Home(failover))

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()

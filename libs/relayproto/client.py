"""A member's connection to one relay: prove the epoch's WireGuard key, then send and receive
WireGuard messages and learn which peers of the epoch the relay can reach. The tunnel keeps
two of these and moves between them (G15).

The client owns its connection and nothing else: it ends when the relay closes, resets,
sends garbage or falls silent (no frame for DEAD_AFTER seconds while pinging every
PING_INTERVAL), and says why; what the messages mean is the tunnel's business."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from libs.contracts.errors import ErrorCode, NodusError
from libs.relayproto.auth import member_proof
from libs.relayproto.connection import DEAD_AFTER, Connection, open_connection
from libs.relayproto.frames import (
    Absent,
    Challenge,
    ErrorFrame,
    FrameError,
    Hello,
    Home,
    Message,
    Ping,
    Pong,
    PresenceDump,
    Present,
    Recv,
    Send,
    Sent,
    encode,
    parts,
)
from libs.relayproto.handshake import HandshakeRefused

log = logging.getLogger("nodus.relay.client")


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
        on_message: Callable[[bytes, Message], None],
        on_presence: Callable[[RelayClient], None] | None = None,
        on_batch_end: Callable[[], None] | None = None,
        takes_totals: bool = False,
        route_key: bytes | None = None,
    ) -> None:
        self.name = name
        # The relay's key, when it takes Route: its address may be a port it shares with the
        # other relays of its host, one of which may answer first.
        self.route_key = route_key
        self.takes_totals = takes_totals  # it announced CAPABILITY_USAGE_TOTALS: `Sent` is known
        self.address = address
        self.gang, self.epoch, self.node = gang, epoch, node
        self._private, self._public = wg_private, wg_public
        self.on_message = on_message
        self.on_presence = on_presence
        self.on_batch_end = on_batch_end  # after the messages of one read: write them out
        self.conn: Connection | None = None
        self.region = ""
        self.welcomed_by = ""
        self.present: set[bytes] = set()  # peers of our epoch this relay can reach
        self.ended = ""  # why the last connection ended

    @property
    def up(self) -> bool:
        return self.conn is not None and not self.conn.closed

    async def connect(self, timeout: float = 5.0) -> None:
        """Raises OSError, TimeoutError, FrameError, or NodusError when the relay refuses."""
        host, _, port = self.address.rpartition(":")
        conn = await open_connection(host.strip("[]"), int(port), timeout)

        def hello(challenge: Challenge) -> Hello:
            proof = member_proof(
                self._private,
                challenge.relay_key,
                challenge.nonce,
                self.gang,
                self.epoch,
                self.node,
            )
            return Hello(self.gang, self.epoch, self.node, self._public, proof)

        try:
            expect = None if self.route_key is None else (self.name, self.route_key)
            welcome = await conn.dial(hello, timeout, expect)
        except HandshakeRefused as refused:
            conn.abort()
            raise NodusError(
                ErrorCode.CONFLICT, f"relay {self.name} refused: {refused.code}: {refused.message}"
            ) from None
        except BaseException:
            conn.abort()
            raise
        self.region = welcome.region
        self.welcomed_by = welcome.relay  # the relay meant, on a shared port too
        self.present = set()
        self.ended = ""
        self.conn = conn

    async def run(self) -> None:
        """Deliver what the relay sends until the connection ends (then `up` is False and
        `ended` says why). Never raises for anything the relay or the network did."""
        conn = self.conn
        if conn is None:
            return
        keepalive = asyncio.get_running_loop().create_task(conn.keep_alive())
        try:
            while not conn.closed:
                frames = await conn.read_frames()
                for frame in frames:
                    if isinstance(frame, Recv):
                        self.on_message(frame.src, frame.message)
                    elif isinstance(frame, Ping):
                        conn.send_nowait(Pong(frame.data))
                    elif isinstance(frame, Present):
                        self._presence(add=(frame.key,))
                    elif isinstance(frame, Absent):
                        self._presence(remove=(frame.key,))
                    elif isinstance(frame, PresenceDump):
                        self.present.clear()
                        self._presence(add=tuple(e.key for e in frame.entries))
                    elif isinstance(frame, ErrorFrame):
                        self.ended = f"relay said {frame.code}: {frame.message}"
                        log.warning("relay %s: %s: %s", self.name, frame.code, frame.message)
                        conn.close()
                if self.on_batch_end is not None:
                    self.on_batch_end()
            self.ended = self.ended or "closed"
        except (ConnectionError, OSError) as error:
            if conn.silent:
                self.ended = f"silent for more than {DEAD_AFTER:g} s"
            else:
                self.ended = self.ended or f"connection ended: {error}"
        except FrameError as error:
            self.ended = f"malformed frame from the relay: {error}"
        finally:
            keepalive.cancel()
            conn.abort()
            if self.present:
                self.present.clear()
                if self.on_presence is not None:
                    self.on_presence(self)

    async def keep(
        self,
        on_up: Callable[[RelayClient], None],
        on_down: Callable[[RelayClient], None],
        log_as: logging.Logger = log,
    ) -> None:
        """Stay connected until cancelled: dial, `on_up`, run, `on_down`, and dial again (at
        once after a connection that lasted, else after a backoff up to 2 s)."""
        backoff = 0.2
        while True:
            try:
                await self.connect()
            except (OSError, TimeoutError, FrameError, NodusError) as error:
                log_as.info("relay %s unavailable: %s", self.name, error or type(error).__name__)
            else:
                backoff = 0.2
                on_up(self)
                began = asyncio.get_running_loop().time()
                await self.run()  # returns when the connection ends, whatever ended it
                log_as.info("relay %s connection ended: %s", self.name, self.ended)
                on_down(self)
                if asyncio.get_running_loop().time() - began > 1.0:
                    continue  # dial again at once (a relay that dropped a paused member, say)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)

    def _presence(self, add: tuple[bytes, ...] = (), remove: tuple[bytes, ...] = ()) -> None:
        self.present.update(add)
        self.present.difference_update(remove)
        if self.on_presence is not None:
            self.on_presence(self)

    def send_now(self, dst: bytes, message: Message | bytearray) -> bool:
        """Queue a WireGuard message without waiting; False when this relay is down (the
        link resends what the peer did not acknowledge)."""
        conn = self.conn
        return conn is not None and conn.send_nowait(Send(dst, message))

    def send_many(
        self, messages: list[tuple[bytes, bytes | bytearray]], sent: int | None = None
    ) -> bool:
        """Queue several WireGuard messages in one write (one system call, not one each),
        then, when given, the member's count of what its programs sent so far (`Sent`)."""
        conn = self.conn
        if conn is None:
            return False
        frames: list[Message] = []
        for dst, message in messages:
            frames += parts(Send(dst, message))
        if sent is not None and self.takes_totals:
            frames.append(encode(Sent(sent)))
        return conn.send_all(frames)

    def backlog(self) -> int:
        conn = self.conn
        return conn.backlog if conn is not None else 0

    async def drain(self) -> None:
        conn = self.conn
        if conn is not None:
            await conn.drain()

    def home(self, failover: bool) -> None:
        if self.conn is not None:
            self.conn.send_nowait(Home(failover))

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()

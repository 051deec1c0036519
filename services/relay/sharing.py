"""Relays of one host sharing one port (443): each listens on it with SO_REUSEPORT, so the
kernel hands a member's connection to any of them. The one that took it challenges the member
as always; a member that meant a sibling answers Route(sibling), and the connection itself (its
file descriptor) is passed to that sibling over a Unix datagram socket, which challenges it
afresh. The member's TCP connection is never re-made, and no byte of its traffic crosses a
process it does not belong to: a handoff costs one message per connection, nothing per byte.

A sibling's door is the abstract Unix socket `nodus-relay:PORT:NAME` of the host's network
namespace. It takes connections only from a process of its own user (the kernel's credentials
on each message), and only TCP sockets."""

from __future__ import annotations

import array
import asyncio
import logging
import os
import socket
import struct
from collections.abc import Callable

from libs.relayproto.connection import Connection

log = logging.getLogger("nodus.relay.sharing")

_UCRED = struct.Struct("iII")  # pid, uid, gid
ROUTED = b"routed"  # the payload beside a handed-on connection: it was routed once already
HANDOFF_WAIT = 2.0  # seconds a connection waits at a busy sibling's door before it is refused


def door(port: int, name: str) -> str:
    """The abstract socket address of relay `name`'s door on shared port `port`."""
    return f"\0nodus-relay:{port}:{name}"


class HandOffError(Exception):
    """The connection could not be handed on: no relay of that name shares this port here."""


class SharedPort:
    """One relay's side of a shared port: its door, where siblings hand it connections (each
    given to `accepted` as a Connection, already routed), and its hand to theirs."""

    def __init__(self, port: int, name: str, accepted: Callable[[Connection], object]) -> None:
        self.port = port
        self.name = name
        self._accepted = accepted
        self._door: socket.socket | None = None
        self._hand = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._hand.setblocking(False)
        self._pending: set[asyncio.Task[object]] = set()

    def open(self) -> None:
        """Open the door; raises OSError when another relay of this name shares the port."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
            sock.bind(door(self.port, self.name))
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._door = sock
        asyncio.get_running_loop().add_reader(sock.fileno(), self._take)

    def close(self) -> None:
        if self._door is not None:
            asyncio.get_running_loop().remove_reader(self._door.fileno())
            self._door.close()
            self._door = None
        self._hand.close()
        for task in self._pending:
            task.cancel()

    async def hand_off(self, conn: Connection, sibling: str) -> None:
        """Pass `conn` to `sibling` and let go of it here. Raises HandOffError."""
        transport = conn.transport
        sock = transport.get_extra_info("socket") if transport is not None else None
        if sock is None or conn.closed:
            raise HandOffError("the connection closed before it could be handed on")
        fd = os.dup(sock.fileno())
        loop = asyncio.get_running_loop()
        deadline = loop.time() + HANDOFF_WAIT
        try:
            rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]).tobytes())]
            while True:
                try:
                    self._hand.sendmsg([ROUTED], rights, 0, door(self.port, sibling))
                    break
                except BlockingIOError:
                    # Its door holds few connections (net.unix.max_dgram_qlen, 10 by default)
                    # until its loop takes them: a burst of members waits its turn.
                    if loop.time() > deadline:
                        raise HandOffError(
                            f"relay {sibling!r} took no connection for {HANDOFF_WAIT:g} s"
                        ) from None
                    await asyncio.sleep(0.002)
        except (ConnectionRefusedError, FileNotFoundError):
            raise HandOffError(
                f"no relay named {sibling!r} shares port {self.port} on this host"
            ) from None
        finally:
            os.close(fd)  # the message in flight holds the connection now
        conn.close()  # this process's hold on it: the socket lives on in the sibling

    def _take(self) -> None:
        """Every connection waiting at the door."""
        assert self._door is not None
        room = socket.CMSG_SPACE(_UCRED.size) + socket.CMSG_SPACE(4 * 4)
        while True:
            try:
                data, ancillary, flags, _ = self._door.recvmsg(64, room)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as error:
                log.warning("shared port %d: door: %s", self.port, error)
                return
            uid, fds = -1, []
            for level, kind, body in ancillary:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    _, uid, _ = _UCRED.unpack(body[: _UCRED.size])
                elif level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    usable = len(body) - len(body) % 4
                    fds += array.array("i", body[:usable]).tolist()
            if uid != os.geteuid() or len(fds) != 1 or flags & socket.MSG_CTRUNC:
                log.warning(
                    "shared port %d: refused a handoff (%d descriptors from uid %d)",
                    self.port,
                    len(fds),
                    uid,
                )
                for fd in fds:
                    os.close(fd)
                continue
            try:
                handed = socket.socket(fileno=fds[0])
            except OSError as error:  # closed by its sender's peer meanwhile, say
                os.close(fds[0])
                log.warning("shared port %d: a handoff: %s", self.port, error)
                continue
            self._adopt(handed, routed=data == ROUTED)

    def _adopt(self, sock: socket.socket, routed: bool) -> None:
        if sock.type != socket.SOCK_STREAM or sock.family not in (
            socket.AF_INET,
            socket.AF_INET6,
        ):
            log.warning("shared port %d: a handoff that is not a TCP connection", self.port)
            sock.close()
            return
        loop = asyncio.get_running_loop()

        def made(conn: Connection) -> None:
            conn.routed = routed
            self._accepted(conn)

        task = loop.create_task(
            loop.connect_accepted_socket(lambda: Connection(on_made=made), sock)
        )
        self._pending.add(task)
        task.add_done_callback(self._adopted)

    def _adopted(self, task: asyncio.Task[object]) -> None:
        self._pending.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("shared port %d: a handed-on connection: %s", self.port, task.exception())

"""What the real-programs tests' peer server does with each connection (chatter, resets,
half-closes, request-response), each returning what it saw."""

from __future__ import annotations

import errno
import hashlib
import select
import socket
import struct
import time
from typing import Any

from tests.e2e.programs.netclient import (
    CHUNK,
    TO_CLIENT,
    TO_SERVER,
    Receiver,
    digest_of,
    expected_response,
    pattern,
    send_pattern,
)


def chatter(sock: socket.socket) -> dict[str, Any]:
    """Send and receive at once until the client ends the connection (it resets)."""
    sock.setblocking(False)
    piece = next(pattern(TO_CLIENT, CHUNK))
    started = time.monotonic()
    outcome = "timeout"
    while time.monotonic() - started < 20:
        readable, writable, _ = select.select([sock], [sock], [], 1.0)
        try:
            if writable:
                sock.send(piece)
            if readable and not sock.recv(CHUNK):
                outcome = "eof"
                break
        except (BlockingIOError, InterruptedError):
            continue
        except OSError as error:
            outcome = errno.errorcode.get(error.errno or 0, str(error))
            break
    return {"outcome": outcome, "seconds": round(time.monotonic() - started, 3)}


def resetting(sock: socket.socket) -> dict[str, Any]:
    """Send 1 MiB and read 256 KiB while the client sends, then reset (SO_LINGER 0)."""
    sock.settimeout(20)
    for piece in pattern(TO_CLIENT, 1 << 20):
        sock.sendall(piece)
    got = 0
    while got < 256 << 10:
        data = sock.recv(CHUNK)
        if not data:
            return {"error": "EOF before 256 KiB"}
        got += len(data)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    return {"reset": True}


HALF = 4 << 20


def half_tx_server(sock: socket.socket) -> dict[str, Any]:
    """Read to the client's EOF (it shut down its side), then answer: sha256 + HALF bytes."""
    sock.settimeout(60)
    digest = hashlib.sha256()
    count = 0
    while data := sock.recv(CHUNK):
        digest.update(data)
        count += len(data)
    sock.sendall(digest.digest())
    send_pattern(sock, TO_CLIENT, HALF)
    return {"received": count, "ok": digest.hexdigest() == digest_of(TO_SERVER, HALF)}


def half_rx_server(sock: socket.socket) -> dict[str, Any]:
    """Send HALF bytes, shut down this side, then read the client's HALF bytes to EOF."""
    sock.settimeout(60)
    send_pattern(sock, TO_CLIENT, HALF)
    sock.shutdown(socket.SHUT_WR)
    receiver = Receiver()
    receiver.run(sock)
    return {
        "received": receiver.count,
        "ok": receiver.count == HALF and receiver.digest.hexdigest() == digest_of(TO_SERVER, HALF),
        "error": receiver.error,
    }


def request_response(sock: socket.socket) -> dict[str, Any]:
    sock.settimeout(10)
    request = b""
    while not request.endswith(b"\n"):
        data = sock.recv(256)
        if not data:
            return {"error": "EOF before the request line"}
        request += data
    sock.sendall(expected_response(request))
    return {}

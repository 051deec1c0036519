"""Clients the real-program tests run with a rank's environment, the shim preloaded
(`python -m tests.e2e.programs.netclient MODE HOST PORT ...`). Each prints one JSON line.

    transfer   HOST PORT SIZE       SIZE bytes each way at once, both verified (sha256); the
                                    longest wait between two deliveries to this side
    rr         HOST PORT COUNT      COUNT connections in a row: a request line, the response
                                    up to EOF, close; stops at the first failure
    reset      HOST PORT            send and receive at once, then close with SO_LINGER 0 (RST)
                                    with data in flight both ways
    until-end  HOST PORT            send and receive at once until the server ends it (it
                                    resets): how the end looked and when
    half-tx    HOST PORT SIZE       send SIZE, shutdown(SHUT_WR), read the reply to EOF: the
                                    sha256 of what was sent, then SIZE bytes of pattern
    half-rx    HOST PORT SIZE       read to EOF (the server sends SIZE, then shuts its side),
                                    then send SIZE bytes and close
    connect    HOST PORT TIMEOUT    one connect with socket.settimeout: the errno and the time

The byte patterns are shared with the servers in tests/e2e/relayed_lab.py (`pattern`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import random
import select
import socket
import struct
import sys
import threading
import time
from collections.abc import Iterator
from functools import cache
from typing import Any

BLOCK = 1 << 20
CHUNK = 1 << 16
TO_SERVER = "client-to-server"
TO_CLIENT = "server-to-client"


@cache
def _blocks(seed: str) -> tuple[bytes, ...]:
    return tuple(random.Random(f"{seed}-{i}").randbytes(BLOCK) for i in range(8))


def pattern(seed: str, size: int) -> Iterator[bytes]:
    """`size` deterministic bytes in chunks of at most BLOCK."""
    blocks = _blocks(seed)
    sent = 0
    index = 0
    while sent < size:
        block = blocks[(index * 5 + 3) % len(blocks)]
        piece = block[: min(BLOCK, size - sent)]
        sent += len(piece)
        index += 1
        yield piece


def digest_of(seed: str, size: int) -> str:
    digest = hashlib.sha256()
    for piece in pattern(seed, size):
        digest.update(piece)
    return digest.hexdigest()


class Receiver:
    """Reads a socket to EOF: bytes, sha256, and the longest wait between two deliveries."""

    def __init__(self) -> None:
        self.count = 0
        self.digest = hashlib.sha256()
        self.max_gap = 0.0
        self.error: str | None = None
        self.done = threading.Event()
        self._last: float | None = None

    def run(self, sock: socket.socket) -> None:
        try:
            while data := sock.recv(CHUNK):
                now = time.monotonic()
                if self._last is not None:
                    self.max_gap = max(self.max_gap, now - self._last)
                self._last = now
                self.count += len(data)
                self.digest.update(data)
        except OSError as error:
            self.error = f"{type(error).__name__}: {error}"
        finally:
            self.done.set()


def send_pattern(sock: socket.socket, seed: str, size: int) -> None:
    for piece in pattern(seed, size):
        sock.sendall(piece)


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def errno_name(error: OSError) -> str:
    return errno.errorcode.get(error.errno or 0, str(error.errno))


def transfer(host: str, port: int, size: int) -> None:
    started = time.monotonic()
    try:
        sock = socket.create_connection((host, port), timeout=30)
    except OSError as error:
        emit(mode="transfer", received=0, digestOk=False, connectError=f"{error!r}")
        return
    sock.settimeout(120)
    receiver = Receiver()
    reading = threading.Thread(target=receiver.run, args=(sock,), daemon=True)
    reading.start()
    send_error: str | None = None
    try:
        send_pattern(sock, TO_SERVER, size)
        sock.shutdown(socket.SHUT_WR)
    except OSError as error:
        send_error = f"{type(error).__name__}: {error}"
    reading.join(150)
    sock.close()
    emit(
        mode="transfer",
        received=receiver.count,
        digestOk=receiver.count == size
        and receiver.digest.hexdigest() == digest_of(TO_CLIENT, size),
        maxGap=round(receiver.max_gap, 3),
        seconds=round(time.monotonic() - started, 3),
        sendError=send_error,
        receiveError=receiver.error,
    )


def request_response(host: str, port: int, count: int) -> None:
    started = time.monotonic()
    slowest = 0.0
    for index in range(count):
        t0 = time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=10) as sock:
                sock.settimeout(10)
                request = f"request {index}\n".encode()
                sock.sendall(request)
                response = b""
                while data := sock.recv(CHUNK):
                    response += data
        except OSError as error:
            emit(mode="rr", ok=index, failedAt=index, error=f"{type(error).__name__}: {error}")
            return
        if response != expected_response(request):
            emit(mode="rr", ok=index, failedAt=index, error=f"wrong response {response[:80]!r}")
            return
        slowest = max(slowest, time.monotonic() - t0)
    emit(
        mode="rr",
        ok=count,
        failedAt=None,
        error=None,
        seconds=round(time.monotonic() - started, 3),
        slowest=round(slowest, 3),
    )


def expected_response(request: bytes) -> bytes:
    """What the request/response server answers: the request, padded to 1 KiB."""
    return request.ljust(1024, b".")


def _both_ways(sock: socket.socket, until_received: int | None, deadline: float) -> dict[str, Any]:
    """Send and receive at once (non-blocking, one thread) until `until_received` bytes came in,
    or, when None, until the connection ends; returns counts and how it ended."""
    sock.setblocking(False)
    piece = next(pattern(TO_SERVER, CHUNK))
    sent = received = 0
    outcome = "eof"
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            outcome = "timeout"
            break
        readable, writable, _ = select.select([sock], [sock], [], min(left, 1.0))
        try:
            if writable:
                sent += sock.send(piece)
            if readable:
                data = sock.recv(CHUNK)
                if not data:
                    outcome = "eof"
                    break
                received += len(data)
                if until_received is not None and received >= until_received:
                    outcome = "enough"
                    break
        except (BlockingIOError, InterruptedError):
            continue
        except OSError as error:
            outcome = errno_name(error)
            break
    return {"sent": sent, "received": received, "outcome": outcome}


def reset(host: str, port: int) -> None:
    """Data in flight both ways, then an RST from this side."""
    sock = socket.create_connection((host, port), timeout=30)
    result = _both_ways(sock, 4 << 20, time.monotonic() + 30)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()  # unread data and unsent data: the kernel sends RST
    emit(mode="reset", **result)


def until_end(host: str, port: int) -> None:
    """The server resets while this side sends and receives: how did it end, and when."""
    started = time.monotonic()
    sock = socket.create_connection((host, port), timeout=30)
    result = _both_ways(sock, None, time.monotonic() + 20)
    sock.close()
    emit(mode="until-end", seconds=round(time.monotonic() - started, 3), **result)


def half_tx(host: str, port: int, size: int) -> None:
    sock = socket.create_connection((host, port), timeout=30)
    sock.settimeout(60)
    error: str | None = None
    receiver = Receiver()
    try:
        send_pattern(sock, TO_SERVER, size)
        sock.shutdown(socket.SHUT_WR)
        receiver.run(sock)
    except OSError as failure:
        error = f"{type(failure).__name__}: {failure}"
    sock.close()
    expected = hashlib.sha256(bytes.fromhex(digest_of(TO_SERVER, size)))
    for piece in pattern(TO_CLIENT, size):
        expected.update(piece)
    emit(
        mode="half-tx",
        received=receiver.count,
        ok=receiver.count == 32 + size and receiver.digest.hexdigest() == expected.hexdigest(),
        error=error or receiver.error,
    )


def half_rx(host: str, port: int, size: int) -> None:
    sock = socket.create_connection((host, port), timeout=30)
    sock.settimeout(60)
    receiver = Receiver()
    receiver.run(sock)  # the server sends `size`, then shuts down its side
    error = receiver.error
    if error is None:
        try:
            send_pattern(sock, TO_SERVER, size)
        except OSError as failure:
            error = f"{type(failure).__name__}: {failure}"
    sock.close()
    emit(
        mode="half-rx",
        received=receiver.count,
        ok=receiver.count == size and receiver.digest.hexdigest() == digest_of(TO_CLIENT, size),
        error=error,
    )


def connect(host: str, port: int, timeout: float) -> None:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.settimeout(timeout)
    started = time.monotonic()
    try:
        sock.connect((host, port))
        name = "connected"
    except TimeoutError:
        name = "timeout"
    except OSError as error:
        name = errno_name(error)
    emit(mode="connect", outcome=name, seconds=round(time.monotonic() - started, 3))
    sock.close()


def main(argv: list[str]) -> int:
    mode, host, port, *rest = argv
    if mode == "transfer":
        transfer(host, int(port), int(rest[0]))
    elif mode == "rr":
        request_response(host, int(port), int(rest[0]))
    elif mode == "reset":
        reset(host, int(port))
    elif mode == "until-end":
        until_end(host, int(port))
    elif mode == "half-tx":
        half_tx(host, int(port), int(rest[0]))
    elif mode == "half-rx":
        half_rx(host, int(port), int(rest[0]))
    elif mode == "connect":
        connect(host, int(port), float(rest[0]))
    else:
        print(f"unknown mode {mode}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

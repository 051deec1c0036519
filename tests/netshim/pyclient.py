"""Python programs the shim tests run with the shim preloaded (python -m tests.netshim.pyclient
MODE ...). Each prints one JSON object per line on stdout.

    blocking HOST PORT [TIMEOUT]   socket.create_connection, echo, getpeername
    asyncio  HOST PORT LOOP        asyncio.open_connection on the asyncio or the uvloop loop
    bypass   PEER PPORT OTHER OPORT UDPPORT UNIXPATH
                                   TCP to a non-peer, UDP to the peer, a Unix socket, then
                                   (last, the control) TCP to the peer
    dup      HOST PORT             getpeername through socket.dup, os.dup, os.dup2
    fork     HOST PORT             connect, os.fork, the child echoes on the inherited socket
    spawn    HOST PORT             a child process (inherits LD_PRELOAD) connects
    error    HOST PORT [TIMEOUT]   connect and report the errno name
    family6  HOST PORT             an AF_INET6 socket (HOST may be ::ffff:a.b.c.d)
    fastopen HOST PORT             TCP Fast Open: sendto(MSG_FASTOPEN) without connect()
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import socket
import subprocess
import sys
from typing import Any


def emit(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


def address(peer: Any) -> str:
    host, port = peer[0], peer[1]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def echo(sock: socket.socket, message: bytes) -> bytes:
    sock.sendall(message)
    got = b""
    while len(got) < len(message):
        chunk = sock.recv(len(message) - len(got))
        if not chunk:
            break
        got += chunk
    return got


def blocking(host: str, port: int, timeout: float | None) -> None:
    with socket.create_connection((host, port), timeout=timeout) as sock:
        emit(
            echo=echo(sock, b"hello").decode(),
            peer=address(sock.getpeername()),
            local=address(sock.getsockname()),
            blocking=sock.getblocking(),
            timeout=sock.gettimeout(),
        )


def family6(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect((host, port))
        emit(echo=echo(sock, b"six").decode(), peer=address(sock.getpeername()))


def fastopen(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.sendto(b"tfo", socket.MSG_FASTOPEN, (host, port))
        got = b""
        while len(got) < 3:
            chunk = sock.recv(3 - len(got))
            if not chunk:
                break
            got += chunk
        emit(echo=got.decode(), peer=address(sock.getpeername()))


async def with_asyncio(host: str, port: int) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"async")
    await writer.drain()
    data = await reader.readexactly(5)
    sock = writer.get_extra_info("socket")
    emit(
        echo=data.decode(),
        peer=address(writer.get_extra_info("peername")),
        getpeername=address(sock.getpeername()),
        loop=type(asyncio.get_running_loop()).__module__,
    )
    writer.close()
    await writer.wait_closed()


def bypass(peer: str, pport: int, other: str, oport: int, udp_port: int, unix_path: str) -> None:
    with socket.create_connection((other, oport), timeout=10) as sock:
        emit(
            step="non-peer", echo=echo(sock, b"direct").decode(), local=address(sock.getsockname())
        )
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        udp.settimeout(10)
        udp.connect((peer, udp_port))  # a connected UDP socket: connect() is hooked, must pass
        udp.send(b"datagram")
        data = udp.recv(100)
        emit(step="udp", echo=data.decode(), local=address(udp.getsockname()))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as unix:
        unix.settimeout(10)
        unix.connect(unix_path)
        emit(step="unix", echo=echo(unix, b"unix").decode())
    with socket.create_connection((peer, pport), timeout=10) as sock:
        emit(step="peer", echo=echo(sock, b"control").decode(), peer=address(sock.getpeername()))


def dup(host: str, port: int) -> None:
    sock = socket.create_connection((host, port), timeout=10)
    copy = sock.dup()  # fcntl(F_DUPFD_CLOEXEC)
    raw = os.dup(sock.fileno())
    os.dup2(sock.fileno(), 90)
    sock.close()
    from_raw = socket.socket(fileno=raw)
    from_dup2 = socket.socket(fileno=90)
    emit(
        dup=address(copy.getpeername()),
        os_dup=address(from_raw.getpeername()),
        dup2=address(from_dup2.getpeername()),
        echo=echo(copy, b"dup").decode(),
    )


def fork(host: str, port: int) -> None:
    sock = socket.create_connection((host, port), timeout=10)
    pid = os.fork()
    if pid == 0:
        try:
            emit(who="child", peer=address(sock.getpeername()), echo=echo(sock, b"kid").decode())
            with socket.create_connection((host, port), timeout=10) as own:
                emit(
                    who="child-own",
                    peer=address(own.getpeername()),
                    echo=echo(own, b"own").decode(),
                )
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    emit(
        who="parent",
        peer=address(sock.getpeername()),
        echo=echo(sock, b"mom").decode(),
        status=status,
    )


def spawn(host: str, port: int) -> None:
    child = subprocess.run(
        [sys.executable, "-m", "tests.netshim.pyclient", "blocking", host, str(port)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    emit(child_stdout=child.stdout.strip(), child_status=child.returncode)


def error(host: str, port: int, timeout: float | None) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    if timeout is not None:
        sock.settimeout(timeout)
    try:
        sock.connect((host, port))
    except OSError as exc:
        name = errno.errorcode.get(
            exc.errno or 0, "timeout" if exc.errno is None else str(exc.errno)
        )
        emit(errno=name, exception=type(exc).__name__)
        # The socket is usable again: connect() once more gives the same answer, not EISCONN.
        try:
            sock.connect((host, port))
            emit(second="connected")
        except OSError as again:
            emit(second=errno.errorcode.get(again.errno or 0, str(again.errno)))
        return
    finally:
        sock.close()
    emit(errno="0")


def main(argv: list[str]) -> None:
    mode, host, port = argv[0], argv[1], int(argv[2])
    rest = argv[3:]
    if mode == "blocking":
        blocking(host, port, float(rest[0]) if rest else None)
    elif mode == "family6":
        family6(host, port)
    elif mode == "fastopen":
        fastopen(host, port)
    elif mode == "asyncio":
        if rest and rest[0] == "uvloop":
            import uvloop

            uvloop.run(with_asyncio(host, port))
        else:
            asyncio.run(with_asyncio(host, port))
    elif mode == "bypass":
        bypass(host, port, rest[0], int(rest[1]), int(rest[2]), rest[3])
    elif mode == "dup":
        dup(host, port)
    elif mode == "fork":
        fork(host, port)
    elif mode == "spawn":
        spawn(host, port)
    elif mode == "error":
        error(host, port, float(rest[0]) if rest else None)
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main(sys.argv[1:])

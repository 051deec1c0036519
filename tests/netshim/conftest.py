"""Fixtures for the shim's tests: real programs, a real SOCKS5 endpoint, real listeners.

- `socks`: libs.socks5 as its own process (`python -m libs.socks5`) on 127.0.0.1, logging
  every connection it carries to a JSON-lines file: the proof that traffic went through it.
- `echo`: TCP and UDP echo listeners on a "peer" address (127.0.0.2) and a non-peer
  (127.0.0.3), recording where each connection came from.
- `run`: runs a program with the shim preloaded the way the placer renders it.
- `netns`: a network namespace of our own (unshare -n) with routes that make addresses
  unreachable (EHOSTUNREACH), unroutable (ENETUNREACH), prohibited (EACCES) and black-holed
  (no answer), for the error mapping; programs enter it with nsenter.
"""

from __future__ import annotations

import ipaddress
import os
import select
import shutil
import socket
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import cast

import pytest

from libs import netshim
from tests.netshim.support import (
    BLACKHOLED,
    PEER,
    PROHIBITED,
    REPO,
    UNREACHABLE,
    Listener,
    Netns,
    Ran,
    Run,
    Socks,
    StartListener,
    StartSocks,
    clean_env,
)


@pytest.fixture(scope="session")
def shim() -> Path:
    return netshim.ensure_built()


# -- the SOCKS5 endpoint --------------------------------------------------------------------


def _first_line(proc: subprocess.Popen[bytes], timeout: float) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    line = b""
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or proc.poll() is not None:
            raise RuntimeError(f"the SOCKS endpoint did not start (exit {proc.poll()})")
        ready, _, _ = select.select([proc.stdout], [], [], left)
        if ready:
            byte = proc.stdout.read(1)
            if not byte:
                raise RuntimeError("the SOCKS endpoint closed its stdout")
            line += byte
    return line.decode().strip()


@pytest.fixture
def start_socks(tmp_path: Path) -> Iterator[StartSocks]:
    started: list[Socks] = []

    def start(
        listen: str = "127.0.0.1:0", dial_timeout: float = 5.0, prefix: Sequence[str] = ()
    ) -> Socks:
        events = tmp_path / f"socks-{len(started)}.jsonl"
        proc = subprocess.Popen(
            [
                *prefix,
                sys.executable,
                "-m",
                "libs.socks5",
                "--listen",
                listen,
                "--events",
                str(events),
                "--dial-timeout",
                str(dial_timeout),
            ],
            cwd=REPO,
            env=clean_env(),
            stdout=subprocess.PIPE,
            bufsize=0,  # unbuffered: select() then sees every byte not yet read
        )
        try:
            line = _first_line(proc, 15)
        except RuntimeError:
            proc.kill()
            proc.wait(5)
            raise
        assert line.startswith("listening "), line
        host, _, port = line.removeprefix("listening ").rpartition(":")
        socks = Socks(proc, host.strip("[]"), int(port), events)
        started.append(socks)
        return socks

    yield start
    for socks in started:
        socks.stop()


@pytest.fixture
def socks(start_socks: StartSocks) -> Socks:
    return start_socks()


# -- listeners ------------------------------------------------------------------------------


class _Recording:
    """A server that remembers where each connection or datagram came from."""

    seen: list[tuple[str, int]]


class _EchoHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        seen = cast(_Recording, self.server).seen
        seen.append((self.client_address[0], self.client_address[1]))
        sock: socket.socket = self.request
        sock.settimeout(20)
        try:
            while data := sock.recv(65536):
                sock.sendall(data)
        except OSError:
            pass


class _UdpEchoHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        seen = cast(_Recording, self.server).seen
        seen.append((self.client_address[0], self.client_address[1]))
        data, sock = self.request
        sock.sendto(data, self.client_address)


class _TCP(_Recording, socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 256  # the default 5 drops bursts of connects: SYN retries, seconds


class _TCP6(_TCP):
    address_family = socket.AF_INET6


class _UDP(_Recording, socketserver.ThreadingUDPServer):
    daemon_threads = True


@pytest.fixture
def listen() -> Iterator[StartListener]:
    """listen(host, port=0, kind="tcp"|"udp") -> a running echo listener."""
    servers: list[socketserver.BaseServer] = []

    def start(host: str, port: int = 0, kind: str = "tcp") -> Listener:
        server: _UDP | _TCP
        if kind == "udp":
            server = _UDP((host, port), _UdpEchoHandler)
        elif ":" in host:
            server = _TCP6((host, port), _EchoHandler)
        else:
            server = _TCP((host, port), _EchoHandler)
        seen: list[tuple[str, int]] = []
        server.seen = seen
        threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()
        servers.append(server)
        return Listener(host, int(server.server_address[1]), seen)

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def echo(listen: StartListener) -> Listener:
    return listen(PEER)


# -- running programs with the shim ---------------------------------------------------------


@pytest.fixture
def run(shim: Path) -> Run:
    def run(
        command: Sequence[str],
        *,
        socks: str | None,
        peers: Sequence[str] = (PEER,),
        env: dict[str, str] | None = None,
        timeout: float = 30.0,
        prefix: Sequence[str] = (),
        preload: bool = True,
    ) -> Ran:
        base = clean_env()
        if preload:
            base = netshim.preload_env(base, peers=peers, socks=socks or "", shim=shim)
            if socks is None:
                base.pop(netshim.ENV_SOCKS)
        base.update(env or {})
        done = subprocess.run(
            [*prefix, *command],
            cwd=REPO,
            env=base,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        return Ran(done.returncode, done.stdout, done.stderr)

    return run


# -- a network namespace of our own ---------------------------------------------------------


def network(address: str) -> str:
    return str(ipaddress.ip_network(f"{address}/16", strict=False))


@pytest.fixture
def netns() -> Iterator[Netns]:
    if os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("nsenter") is None:
        pytest.skip("network namespaces need root, unshare and nsenter")
    setup = (
        "ip link set lo up"
        f" && ip route add unreachable {network(UNREACHABLE)}"
        f" && ip route add prohibit {network(PROHIBITED)}"
        f" && ip route add {network(BLACKHOLED)} dev lo"
        " && echo ready && exec sleep 300"
    )
    holder = subprocess.Popen(
        ["unshare", "--net", "--", "sh", "-c", setup],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None
        ready, _, _ = select.select([holder.stdout], [], [], 10)
        if not ready or holder.stdout.readline().strip() != b"ready":
            holder.kill()
            _, err = holder.communicate(timeout=5)
            pytest.skip(f"cannot set up a network namespace: {err.decode().strip()}")
        yield Netns(holder)
    finally:
        holder.kill()
        holder.wait(5)

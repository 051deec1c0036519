"""Errors a redirected connect() gives mean what a direct connect() would have meant, so the
retry loops of NCCL, Gloo and torch behave as they do without the shim.

Real failures, not stand-ins: a closed port; in a network namespace of our own, addresses
that are unreachable, unroutable, prohibited and black-holed (where the same program without
the shim gets the same errno); a SOCKS endpoint that is down, silent, or not what it should
be. After each failure the same socket can connect() again."""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Iterator

import pytest

from tests.netshim.support import (
    BLACKHOLED,
    NO_ROUTE,
    PEER,
    PROHIBITED,
    UNREACHABLE,
    Netns,
    Run,
    Socks,
    StartSocks,
    free_port,
    nbconnect,
    pyclient,
)

pytestmark = pytest.mark.timeout(90)


# -- the peer ------------------------------------------------------------------------------


def test_closed_port_is_econnrefused(run: Run, socks: Socks) -> None:
    port = free_port()
    for mode in ("connect", "blocking"):
        out = run(nbconnect(mode, PEER, port), socks=socks.address).line
        assert out["result"] == "error"
        assert out["errno"] == "ECONNREFUSED"
        assert out["stage"] == "connect"  # at once, as on loopback without the shim

    lines = run(pyclient("error", PEER, port), socks=socks.address).lines
    assert lines[0] == {"errno": "ECONNREFUSED", "exception": "ConnectionRefusedError"}
    assert lines[1] == {"second": "ECONNREFUSED"}  # the socket was reset: not EISCONN

    ran = run(["curl", "-sS", "--max-time", "10", f"http://{PEER}:{port}/"], socks=socks.address)
    assert ran.returncode == 7  # CURLE_COULDNT_CONNECT
    assert "Connection refused" in ran.stderr or "Couldn't connect" in ran.stderr

    assert socks.replies(5) == [5, 5, 5, 5, 5]  # every attempt went through the endpoint


UNREACHABLE_CASES = [
    # (address, errno, SOCKS reply, what the route does)
    (UNREACHABLE, "EHOSTUNREACH", 4, "unreachable route"),
    (NO_ROUTE, "ENETUNREACH", 3, "no route"),
    (PROHIBITED, "EACCES", 2, "prohibit route"),
]


@pytest.mark.parametrize(("address", "expected", "reply", "why"), UNREACHABLE_CASES)
def test_unreachable_peer_gives_the_errno_of_a_direct_connect(
    run: Run,
    start_socks: StartSocks,
    netns: Netns,
    address: str,
    expected: str,
    reply: int,
    why: str,
) -> None:
    socks = start_socks(prefix=netns.prefix)
    peers = [address]
    direct = run(nbconnect("connect", address, 80), socks=None, preload=False, prefix=netns.prefix)
    assert direct.line["errno"] == expected, f"{why}: the kernel itself says {direct.line}"

    out = run(
        nbconnect("connect", address, 80), socks=socks.address, peers=peers, prefix=netns.prefix
    )
    assert out.line["result"] == "error"
    assert out.line["errno"] == expected, why

    lines = run(
        pyclient("error", address, 80, 10), socks=socks.address, peers=peers, prefix=netns.prefix
    ).lines
    assert lines[0]["errno"] == expected
    assert lines[1]["second"] == expected

    assert socks.replies(3) == [reply, reply, reply]


@pytest.mark.slow
def test_peer_that_never_answers_is_etimedout(
    run: Run, start_socks: StartSocks, netns: Netns
) -> None:
    # The endpoint gives up dialing after 1 s (reply 6, TTL expired) -> ETIMEDOUT.
    socks = start_socks(prefix=netns.prefix, dial_timeout=1.0)
    started = time.monotonic()
    out = run(
        nbconnect("connect", BLACKHOLED, 80),
        socks=socks.address,
        peers=[BLACKHOLED],
        prefix=netns.prefix,
    ).line
    took = time.monotonic() - started
    assert out["errno"] == "ETIMEDOUT"
    assert 0.9 < took < 20  # 1 s of dialing, plus process start-up on a busy machine
    assert socks.replies(1) == [6]


# -- the SOCKS endpoint --------------------------------------------------------------------


def test_socks_endpoint_down_is_econnrefused(run: Run) -> None:
    """Documented choice: an endpoint that is down refuses like a peer not listening yet, so
    retry loops keep trying while the agent restarts."""
    down = f"127.0.0.1:{free_port('127.0.0.1')}"
    for mode in ("connect", "blocking"):
        out = run(nbconnect(mode, PEER, 9), socks=down).line
        assert out["errno"] == "ECONNREFUSED"
    lines = run(pyclient("error", PEER, 9), socks=down).lines
    assert lines == [
        {"errno": "ECONNREFUSED", "exception": "ConnectionRefusedError"},
        {"second": "ECONNREFUSED"},
    ]


def test_misconfigured_endpoint_is_enetunreach(run: Run, listen: object) -> None:
    # NODUS_NETSHIM_SOCKS missing, or an IPv6 endpoint for an AF_INET socket.
    assert run(nbconnect("connect", PEER, 9), socks=None).line["errno"] == "ENETUNREACH"
    assert (
        run(nbconnect("connect", PEER, 9), socks="not-an-endpoint").line["errno"] == "ENETUNREACH"
    )
    assert run(nbconnect("connect", PEER, 9), socks="[::1]:1080").line["errno"] == "ENETUNREACH"


class ScriptedEndpoint:
    """A fake SOCKS endpoint that answers the way a broken one would."""

    def __init__(self, script: str) -> None:
        self.script = script
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(20)
        try:
            if self.script == "silent":
                conn.recv(100)
                conn.recv(100)  # holds the connection, says nothing
                return
            conn.recv(3)
            if self.script == "garbage":
                conn.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n")
            elif self.script == "auth":
                conn.sendall(b"\x05\xff")
            elif self.script == "close":
                conn.close()
            elif self.script.startswith("reply:"):
                conn.sendall(b"\x05\x00")
                conn.recv(10)
                code = int(self.script.removeprefix("reply:"))
                conn.sendall(
                    bytes([5, code, 0, 1]) + socket.inet_aton("0.0.0.0") + struct.pack(">H", 0)
                )
            conn.recv(100)
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()
        for conn in self.conns:
            conn.close()


@pytest.fixture
def scripted() -> Iterator[list[ScriptedEndpoint]]:
    endpoints: list[ScriptedEndpoint] = []
    yield endpoints
    for endpoint in endpoints:
        endpoint.close()


@pytest.mark.parametrize(
    ("script", "expected"),
    [
        ("garbage", "EPROTO"),  # not SOCKS5 at all
        ("auth", "EACCES"),  # wants a method we do not offer
        ("close", "ECONNREFUSED"),  # went away mid-handshake: as if down
        ("reply:1", "ECONNABORTED"),  # general failure
        ("reply:2", "EACCES"),  # not allowed by ruleset (e.g. not a gang member)
        ("reply:3", "ENETUNREACH"),
        ("reply:4", "EHOSTUNREACH"),
        ("reply:5", "ECONNREFUSED"),
        ("reply:6", "ETIMEDOUT"),
        ("reply:7", "EPROTO"),  # command not supported: not a usable endpoint
        ("reply:8", "EAFNOSUPPORT"),
        ("reply:200", "EPROTO"),  # a code RFC 1928 does not define
    ],
)
def test_endpoint_answers_map_to_errnos(
    run: Run, scripted: list[ScriptedEndpoint], script: str, expected: str
) -> None:
    endpoint = ScriptedEndpoint(script)
    scripted.append(endpoint)
    out = run(nbconnect("connect", PEER, 9), socks=endpoint.address).line
    assert out["errno"] == expected


def test_silent_endpoint_times_out_within_the_bound(
    run: Run, scripted: list[ScriptedEndpoint]
) -> None:
    endpoint = ScriptedEndpoint("silent")
    scripted.append(endpoint)
    env = {"NODUS_NETSHIM_TIMEOUT_MS": "300"}
    out = run(nbconnect("connect", PEER, 9), socks=endpoint.address, env=env).line
    assert out["errno"] == "ETIMEDOUT"
    assert 250 <= out["ms"] < 3000
    lines = run(pyclient("error", PEER, 9), socks=endpoint.address, env=env).lines
    assert lines[0]["errno"] == "ETIMEDOUT" and lines[0]["exception"] == "TimeoutError"
    assert lines[1]["second"] == "ETIMEDOUT"  # reset and tried again, not EISCONN

"""The shim in real programs (G14): TCP connections to peers go through a real SOCKS5
endpoint, everything else goes out untouched; proved by what the endpoint logged and by
where the listener saw each connection come from.

A connection the endpoint carried reaches the listener from the endpoint's own socket (the
`via` address it logs); a direct one from the client's socket. Both sides are compared."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from tests.netshim.support import (
    OTHER,
    PEER,
    Listener,
    Ran,
    Run,
    Socks,
    StartListener,
    clean_env,
    free_port,
    nbconnect,
    pyclient,
)

pytestmark = pytest.mark.timeout(60)


def address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def carried(socks: Socks, listener: Listener, count: int = 1) -> list[dict[str, Any]]:
    """The endpoint connected `count` times to the listener, and the listener saw exactly those
    connections arrive from the endpoint's side of them."""
    target = (listener.host, listener.port)
    events = socks.wait_for(
        lambda evs: (
            sum(1 for e in evs if e["event"] == "closed" and (e["host"], e["port"]) == target)
            >= count
        )
    )
    connected = [
        e
        for e in events
        if e["event"] == "connected" and (e["host"], e["port"]) == target and e["reply"] == 0
    ]
    assert len(connected) == count, events
    seen = {address(host, port) for host, port in listener.seen}
    assert {e["via"] for e in connected} <= seen, (connected, listener.seen)
    return events


def test_python_blocking_socket_reaches_the_peer_through_socks(
    run: Run, socks: Socks, echo: Listener
) -> None:
    ran = run(pyclient("blocking", PEER, echo.port), socks=socks.address)
    out = ran.line
    assert out["echo"] == "hello"
    assert out["peer"] == address(PEER, echo.port)  # getpeername names the peer
    assert out["blocking"] is True
    events = carried(socks, echo)
    closed = [e for e in events if e["event"] == "closed"]
    assert closed[0]["bytes_up"] == 5 and closed[0]["bytes_down"] == 5
    assert ran.stderr == ""  # silent unless NODUS_NETSHIM_DEBUG


def test_python_socket_with_a_timeout_is_non_blocking_and_redirected(
    run: Run, socks: Socks, echo: Listener
) -> None:
    # settimeout() makes CPython use a non-blocking socket + poll for connect().
    out = run(pyclient("blocking", PEER, echo.port, 5), socks=socks.address).line
    assert out["echo"] == "hello"
    assert out["peer"] == address(PEER, echo.port)
    assert out["timeout"] == 5.0
    carried(socks, echo)


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_asyncio_open_connection_reaches_the_peer(
    run: Run, socks: Socks, echo: Listener, loop: str
) -> None:
    out = run(pyclient("asyncio", PEER, echo.port, loop), socks=socks.address).line
    assert out["echo"] == "async"
    assert out["peer"] == address(PEER, echo.port)  # the transport's peername
    assert out["getpeername"] == address(PEER, echo.port)
    assert out["loop"].startswith(loop)
    carried(socks, echo)


def test_curl_reaches_a_web_server_on_the_peer(run: Run, socks: Socks, tmp_path: Path) -> None:
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed (make system-deps)")
    (tmp_path / "index.txt").write_text("served from the peer\n")
    port = free_port()
    server = subprocess.Popen(
        ["python3", "-m", "http.server", "--bind", PEER, str(port), "-d", str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=clean_env(),
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection((PEER, port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        before = len(socks.events())
        ran = run(
            [
                "curl",
                "-sS",
                "--max-time",
                "10",
                "-w",
                "\\n%{remote_ip}:%{remote_port}",
                f"http://{PEER}:{port}/index.txt",
            ],
            socks=socks.address,
        )
        assert ran.returncode == 0, ran.stderr
        body, _, remote = ran.stdout.rpartition("\n")
        assert body == "served from the peer\n"  # the file, then -w's own newline
        assert remote == f"{PEER}:{port}"  # curl's own getpeername
        events = socks.wait_for(lambda evs: any(e["event"] == "closed" for e in evs[before:]))
        connected = [e for e in events[before:] if e["event"] == "connected"]
        assert [(e["host"], e["port"], e["reply"]) for e in connected] == [(PEER, port, 0)]
    finally:
        server.terminate()
        server.wait(5)


@pytest.mark.parametrize("mode", ["connect", "blocking"])
def test_c_non_blocking_connect_and_poll(run: Run, socks: Socks, echo: Listener, mode: str) -> None:
    """nbconnect does what NCCL and Gloo do: non-blocking connect, poll, SO_ERROR."""
    out = run(nbconnect(mode, PEER, echo.port, "nccl-like"), socks=socks.address).line
    assert out["result"] == "ok", out
    assert out["echo"] == "nccl-like"
    assert out["peer"] == address(PEER, echo.port)
    # Documented: the handshake completes inside connect(), which returns 0; the socket's
    # flags are as the caller set them.
    assert out["connect_returned"] == "0"
    assert out["nonblock"] is (mode == "connect")
    carried(socks, echo)


def test_ipv6_peer_and_ipv4_mapped_destination(
    run: Run, socks: Socks, listen: StartListener
) -> None:
    six = listen("::1")
    out = run(pyclient("family6", "::1", six.port), socks=socks.address, peers=["::1"]).line
    assert out == {"echo": "six", "peer": address("::1", six.port)}
    carried(socks, six)

    # An AF_INET6 socket to ::ffff:127.0.0.2 is a connection to the IPv4 peer 127.0.0.2.
    four = listen(PEER)
    mapped = f"::ffff:{PEER}"
    out = run(pyclient("family6", mapped, four.port), socks=socks.address).line
    assert out == {"echo": "six", "peer": address(mapped, four.port)}
    carried(socks, four)


def test_tcp_fast_open_to_a_peer_is_redirected(run: Run, socks: Socks, echo: Listener) -> None:
    # sendto(MSG_FASTOPEN) connects without connect(): the shim treats it as one.
    out = run(pyclient("fastopen", PEER, echo.port), socks=socks.address).line
    assert out == {"echo": "tfo", "peer": address(PEER, echo.port)}
    carried(socks, echo)


def test_non_peers_udp_and_unix_sockets_bypass_the_endpoint(
    run: Run, socks: Socks, listen: StartListener, tmp_path: Path
) -> None:
    peer = listen(PEER)
    other = listen(OTHER)
    udp = listen(PEER, kind="udp")
    unix_path = tmp_path / "unix.sock"
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(str(unix_path))
    unix.listen(1)

    import threading

    def unix_echo() -> None:
        conn, _ = unix.accept()
        with conn:
            conn.sendall(conn.recv(100))

    threading.Thread(target=unix_echo, daemon=True).start()
    try:
        ran = run(
            pyclient("bypass", PEER, peer.port, OTHER, other.port, udp.port, unix_path),
            socks=socks.address,
        )
    finally:
        unix.close()
    steps = {line["step"]: line for line in ran.lines}
    assert set(steps) == {"non-peer", "udp", "unix", "peer"}, ran
    assert steps["non-peer"]["echo"] == "direct"
    assert steps["udp"]["echo"] == "datagram"
    assert steps["unix"]["echo"] == "unix"
    assert steps["peer"]["echo"] == "control"

    # The control (last) went through the endpoint...
    events = carried(socks, peer)
    # ...and it is the only thing the endpoint ever saw: the non-peer TCP connection and the
    # UDP datagram to the peer's address came before it and are not there.
    assert [(e["host"], e["port"]) for e in events if e["event"] == "connected"] == [
        (PEER, peer.port)
    ]
    # Proved from the other side too: the non-peer and the UDP listener saw the client's own
    # socket, not the endpoint's.
    assert [address(*seen) for seen in other.seen] == [steps["non-peer"]["local"]]
    assert [address(*seen) for seen in udp.seen] == [steps["udp"]["local"]]


def test_getpeername_through_dup_dup2_and_fcntl(run: Run, socks: Socks, echo: Listener) -> None:
    expected = address(PEER, echo.port)
    out = run(pyclient("dup", PEER, echo.port), socks=socks.address).line
    assert out == {"dup": expected, "os_dup": expected, "dup2": expected, "echo": "dup"}

    out = run(nbconnect("dup", PEER, echo.port), socks=socks.address).line
    assert out["dup"] == out["dup2"] == out["dup3"] == out["f_dupfd"] == expected
    assert out["echo_ok"] is True
    # The original fd was closed and its number reused by a new, unconnected socket: it does
    # not inherit the record.
    assert out["reused_number"] is True
    assert out["reused_peer"].startswith("error:")


def test_threads_fork_and_child_processes(run: Run, socks: Socks, echo: Listener) -> None:
    expected = address(PEER, echo.port)
    out = run(nbconnect("threads", PEER, echo.port, 32), socks=socks.address).line
    assert out == {"result": "ok", "threads": 32, "ok": 32}

    ran = run(nbconnect("fork", PEER, echo.port), socks=socks.address)
    child, parent = ran.lines
    assert child["inherited_peer"] == expected and child["inherited_ok"] is True
    assert child["own_peer"] == expected and child["own_ok"] is True
    assert parent["peer"] == expected and parent["ok"] is True and parent["child_status"] == 0

    ran = run(pyclient("fork", PEER, echo.port), socks=socks.address)
    by_who = {line["who"]: line for line in ran.lines}
    assert by_who["child"] == {"who": "child", "peer": expected, "echo": "kid"}
    assert by_who["child-own"] == {"who": "child-own", "peer": expected, "echo": "own"}
    assert by_who["parent"]["echo"] == "mom" and by_who["parent"]["status"] == 0

    # A child process inherits LD_PRELOAD and the variables, so it is redirected too.
    ran = run(pyclient("spawn", PEER, echo.port), socks=socks.address)
    spawned = ran.line
    assert spawned["child_status"] == 0
    assert f'"peer": "{expected}"' in spawned["child_stdout"]

    # 32 + (1 + 1) + (1 + 1) + 1 connections, every one through the endpoint.
    carried(socks, echo, count=37)


def test_the_endpoint_finishes_every_connection_it_splices(
    run: Run, socks: Socks, echo: Listener
) -> None:
    """Many short connections at once: each one the endpoint carried also ends there (a
    connection task collected mid-splice under uvloop once left some open forever)."""
    for _ in range(5):
        out = run(nbconnect("threads", PEER, echo.port, 64), socks=socks.address).line
        assert out["ok"] == 64
    carried(socks, echo, count=5 * 64)


def test_retry_on_the_same_fd_after_econnrefused(
    run: Run, socks: Socks, listen: StartListener, shim: Path
) -> None:
    """NCCL calls connect() again on the same fd after ECONNREFUSED until the peer listens."""
    port = free_port()
    env = clean_env()
    from libs import netshim

    env = netshim.preload_env(env, peers=[PEER], socks=socks.address, shim=shim)
    proc = subprocess.Popen(
        nbconnect("retry", PEER, port, 15000), env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == '{"event":"refused"}'
        late = listen(PEER, port)  # the peer starts listening late
        out = proc.stdout.readline()
        proc.wait(20)
    finally:
        proc.kill()
    result = Ran(proc.returncode or 0, out, "").line
    assert result["result"] == "ok", result
    assert result["refused"] >= 1
    assert result["peer"] == address(PEER, port)
    events = carried(socks, late)
    replies = [e["reply"] for e in events if e["event"] == "connected"]
    assert replies == [5] * result["refused"] + [0]  # refused while nobody listened, then in


def test_debug_lines_only_when_asked(run: Run, socks: Socks, echo: Listener) -> None:
    quiet = run(nbconnect("connect", PEER, echo.port), socks=socks.address)
    assert quiet.stderr == ""
    loud = run(
        nbconnect("connect", PEER, echo.port),
        socks=socks.address,
        env={"NODUS_NETSHIM_DEBUG": "1"},
    )
    assert "nodus-netshim[" in loud.stderr
    assert f"connect fd=3 {PEER}:{echo.port} via {socks.address}: connected" in loud.stderr

"""Small real programs run inside the lab's namespaces: a TCP listener that reports who
connected, a client that says how its connect ended."""

from __future__ import annotations

import subprocess
import sys


def run_python(argv_prefix: list[str], code: str, timeout: float = 10.0) -> str:
    done = subprocess.run(
        [*argv_prefix, sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


LISTEN = """
import socket, sys
s = socket.create_server(("{host}", {port}))
print("ready", flush=True)
s.settimeout(8)
conn, peer = s.accept()
print(peer[0], flush=True)
"""

CONNECT = """
import socket, sys
try:
    socket.create_connection(("{host}", {port}), timeout={timeout}).close()
    print("connected")
except OSError as error:
    print("refused" if isinstance(error, ConnectionRefusedError) else "unreachable")
"""


def seen_by(
    listener: list[str], host: str, client: list[str], target: str, port: int = 7000
) -> str:
    """Connect from `client` to `target`; the address the listener saw, or how it failed."""
    server = subprocess.Popen(
        [*listener, sys.executable, "-c", LISTEN.format(host=host, port=port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        outcome = run_python(client, CONNECT.format(host=target, port=port, timeout=1.5))
        if outcome != "connected":
            return outcome
        return server.stdout.readline().strip()
    finally:
        server.kill()
        server.wait()

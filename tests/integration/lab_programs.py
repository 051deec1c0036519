"""Small real programs run inside the lab's namespaces: a TCP listener that reports who
connected, a client that says how its connect ended."""

from __future__ import annotations

import contextlib
import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

from app.netlab import NetLab, plan
from libs.contracts.base import convert
from libs.contracts.fleet import Fleet


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


REPO = Path(__file__).resolve().parents[2]
# What a program started inside a lab namespace needs to import this tree.
ENV = {"PYTHONPATH": str(REPO), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}


def lab_fleet(*machines: tuple[str, str, str, bool]) -> Fleet:
    """VMs (name, provider, address, behind NAT) in one region of their providers."""
    return convert(
        {
            "machines": [
                {
                    "name": name,
                    "provider": provider,
                    "region": "r1",
                    "regionClass": "us",
                    "offering": "vm",
                    "address": address,
                    "nat": nat,
                    "pool": "p",
                    "cluster": "c",
                    "accelerators": {"count": 1, "backend": "cuda", "model": "L4"},
                }
                for name, provider, address, nat in machines
            ]
        },
        Fleet,
    )


@contextlib.contextmanager
def running_lab(fleet: Fleet, state: Path, reach_from_host: bool = False) -> Iterator[NetLab]:
    """The lab of `fleet` under a prefix of its own, removed afterwards."""
    netlab = NetLab(
        plan(fleet, prefix=f"t{secrets.token_hex(2)}-", reach_from_host=reach_from_host), state
    )
    netlab.create()
    try:
        yield netlab
    finally:
        netlab.destroy()

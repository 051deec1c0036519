"""`nodus relay` as deployed, as a process of its own, for the tests and benches that need a
relay in another process: its own bus user, key file and usage journal, a mesh key shared by
every relay started in the same state directory."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

from libs.bus.server import NatsServer, free_port

REPO = Path(__file__).resolve().parents[1]


def nodus_relay(
    server: NatsServer,
    state: Path,
    name: str,
    credentials: str,
    *extra: str,
    slot: str | None = None,
) -> subprocess.Popen[bytes]:
    """A relay named `name` on a free port; `extra`: more flags (--share-port ...); `slot`:
    where its key and journal live when two processes are given one name (default: the
    name)."""
    mesh_key = state / "mesh.key"
    if not mesh_key.exists():
        mesh_key.write_bytes(os.urandom(32).hex().encode())
    own = slot or name
    argv = [sys.executable, "-m", "app", "relay", "--nats", server.url]
    argv += ["--credentials", credentials, "--name", name, "--region", "eu"]
    argv += ["--listen", f"127.0.0.1:{free_port()}", "--mesh-key-file", str(mesh_key)]
    argv += ["--key-file", str(state / own / "relay.key")]
    argv += ["--usage-journal", str(state / f"{own}.usage"), *extra]
    return subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


async def stderr_once_exited(process: subprocess.Popen[bytes], within: float = 30.0) -> str:
    """What the process said, once it ended by itself; one still running is killed (no test
    leaves a relay behind) and the test fails."""
    try:
        _, err = await asyncio.to_thread(process.communicate, timeout=within)
    except subprocess.TimeoutExpired:
        process.kill()
        await asyncio.to_thread(process.communicate)
        raise AssertionError(f"still running after {within:g} s") from None
    return err.decode()

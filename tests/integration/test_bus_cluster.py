"""`nodus bus init`: the three servers it writes run as a cluster with TLS, replicate the
journal three ways, and confine an agent as the single server does (S1)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from libs.bus import Bus
from libs.bus.auth import agent_inbox, public_key_of
from libs.bus.server import free_port, nats_server_binary
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.errors import NodusError
from libs.contracts.fleet import NodeHealth

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[Path, list[str]]]:
    directory = tmp_path / "bus"
    ports = [(free_port(), free_port()) for _ in range(3)]
    servers = [f"--server=n{i}=127.0.0.1:{c}:{r}" for i, (c, r) in enumerate(ports)]
    init = subprocess.run(
        [sys.executable, "-m", "app", "bus", "init", "--dir", str(directory), "--here",
         "--listen-host", "127.0.0.1", *servers, "--relay", "r1", "--agent", "m1"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert init.returncode == 0, init.stderr
    printed = dict(line.split("=", 1) for line in init.stdout.splitlines() if "=" in line)
    assert printed["NODUS_BUS_REPLICAS"] == "3"
    for user in ("agent-m1", "monitor-m1"):  # a machine's two users, each its own seed
        assert (directory / "users" / f"{user}.nk").stat().st_mode & 0o077 == 0
    processes = [
        subprocess.Popen(
            [nats_server_binary(), "-c", str(directory / "servers" / f"n{i}" / "nats-server.conf")],
            stdout=open(tmp_path / f"n{i}.log", "wb"),
            stderr=subprocess.STDOUT,
        )
        for i in range(3)
    ]
    try:
        yield directory, printed["NODUS_NATS_URL"].split(",")
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=10)


async def _open(url: str, seed: Path, **options: object) -> Bus:
    for _ in range(100):  # the servers elect a JetStream leader first
        try:
            return await Bus.open(url, credentials=str(seed), **options)  # type: ignore[arg-type]
        except NodusError:
            await asyncio.sleep(0.2)
    return await Bus.open(url, credentials=str(seed), **options)  # type: ignore[arg-type]


async def test_the_written_cluster_serves_a_replicated_confined_bus(
    cluster: tuple[Path, list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    directory, urls = cluster
    assert all(u.startswith("tls://") for u in urls)
    monkeypatch.setenv("NODUS_NATS_CA", str(directory / "ca.pem"))
    monkeypatch.setenv("NODUS_BUS_REPLICAS", "3")
    users = directory / "users"
    control = await _open(",".join(urls[:2]), users / "placer.nk", buckets=[names.BUCKET_HEALTH])
    try:
        info = await control.js.stream_info(f"KV_{names.BUCKET_HEALTH}")
        assert info.config.num_replicas == 3
        assert info.cluster is not None and len(info.cluster.replicas or []) == 2
        agent = await _open(
            urls[2],
            users / "agent-m1.nk",
            buckets=[names.BUCKET_HEALTH],
            inbox_prefix=agent_inbox("m1"),
            confined=True,
        )
        try:
            health = agent.bucket(names.BUCKET_HEALTH, NodeHealth)
            beat = NodeHealth(node="m1", healthy=True, heartbeat_time=now(), boot_id="b")
            assert await health.put("m1", beat) > 0
            seen = await control.bucket(names.BUCKET_HEALTH, NodeHealth).get("m1")
            assert seen is not None and seen.value.boot_id == "b"
            agent.js._timeout = 1.0
            with pytest.raises(Exception, match="timeout"):  # another node's: refused
                await agent.bucket(names.BUCKET_HEALTH, NodeHealth).put("m2", beat)
        finally:
            await agent.close()
    finally:
        await control.close()
    # Without the bus's authority the servers are not trusted.
    monkeypatch.delenv("NODUS_NATS_CA")
    with pytest.raises(NodusError):
        await Bus.open(urls[0], credentials=str(users / "placer.nk"))


def test_a_new_machine_gets_its_agents_and_its_monitors_user(tmp_path: Path) -> None:
    """Both run on the machine, each confined to it; the monitor's is what its unit loads."""
    directory = tmp_path / "bus"
    servers = [f"--server=n{i}=127.0.0.1" for i in range(3)]

    def nodus(*args: str) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [sys.executable, "-m", "app", "bus", *args, "--dir", str(directory)],
            cwd=REPO, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done

    nodus("init", "--here", *servers)
    added = nodus("user", "--agent", "gpu-7")
    users = directory / "users"
    assert f"{users / 'monitor-gpu-7.nk'} as /etc/nodus/credentials/monitor.nk" in added.stdout
    conf = (directory / "servers" / "n0" / "authorization.conf").read_text()
    for user in ("agent-gpu-7", "monitor-gpu-7"):
        assert (users / f"{user}.nk").stat().st_mode & 0o077 == 0
        assert public_key_of((users / f"{user}.nk").read_text()) in conf
    assert "_INBOX._monitor.gpu-7.>" in conf and "nodus-signals.gpu-7.*" in conf
    again = nodus("user", "--agent", "gpu-7")  # kept, not made anew
    assert again.stdout == added.stdout

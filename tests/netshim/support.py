"""Helpers the shim's tests share (fixtures are in conftest.py)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from libs import netshim

REPO = Path(__file__).resolve().parents[2]
PEER = "127.0.0.2"
OTHER = "127.0.0.3"
PROGRAMS = netshim.TEST_PROGRAMS


def clean_env() -> dict[str, str]:
    """This environment without proxies (curl would use them) and without a preload."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.lower().endswith("_proxy") and not k.startswith("NODUS_NETSHIM")
    }
    env.pop("LD_PRELOAD", None)
    env["PYTHONPATH"] = str(REPO)
    return env


def json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


@dataclass
class Socks:
    proc: subprocess.Popen[bytes]
    host: str
    port: int
    events_path: Path

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def events(self) -> list[dict[str, Any]]:
        if not self.events_path.exists():
            return []
        # Only whole lines: the endpoint may be writing the next one right now.
        text = self.events_path.read_text()
        return json_lines(text[: text.rfind("\n") + 1])

    def wait_for(
        self, check: Callable[[list[dict[str, Any]]], bool], timeout: float = 20.0
    ) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while True:
            events = self.events()
            if check(events):
                return events
            if time.monotonic() > deadline:
                raise AssertionError(f"SOCKS events never matched; got {events}")
            time.sleep(0.02)

    def replies(self, count: int) -> list[int]:
        """The reply codes of the first `count` CONNECTs, once the endpoint has logged them
        (it logs just after it answered, so a client may be back first)."""
        events = self.wait_for(lambda evs: sum(e["event"] == "connected" for e in evs) >= count)
        return [e["reply"] for e in events if e["event"] == "connected"]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


StartSocks = Callable[..., Socks]


@dataclass
class Listener:
    host: str
    port: int
    seen: list[tuple[str, int]] = field(default_factory=list)


StartListener = Callable[..., Listener]


def free_port(host: str = PEER) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Ran:
    returncode: int
    stdout: str
    stderr: str

    @property
    def lines(self) -> list[dict[str, Any]]:
        return json_lines(self.stdout)

    @property
    def line(self) -> dict[str, Any]:
        lines = self.lines
        assert lines, f"no JSON output; stdout={self.stdout!r} stderr={self.stderr!r}"
        return lines[-1]


Run = Callable[..., Ran]


def pyclient(*args: object) -> list[str]:
    return [sys.executable, "-m", "tests.netshim.pyclient", *(str(a) for a in args)]


def nbconnect(*args: object) -> list[str]:
    return [str(PROGRAMS / "nbconnect"), *(str(a) for a in args)]


UNREACHABLE = "10.250.0.1"  # `ip route add unreachable`: EHOSTUNREACH
NO_ROUTE = "10.251.0.1"  # no route at all: ENETUNREACH
PROHIBITED = "10.249.0.1"  # `ip route add prohibit`: EACCES
BLACKHOLED = "10.252.0.2"  # routed to lo, never answered: the dial times out


@dataclass
class Netns:
    holder: subprocess.Popen[bytes]

    @property
    def prefix(self) -> list[str]:
        return ["nsenter", f"--net=/proc/{self.holder.pid}/ns/net", "--"]

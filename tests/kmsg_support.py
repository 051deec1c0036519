"""Real kernel log records and a real `nodus monitor --kmsg /dev/kmsg`, for the tests and the
bench of the kernel log reader (tests/e2e/test_monitor_kmsg.py, tests/bench/kmsg.py).

Records are written into this machine's /dev/kmsg as root. Every record a test writes carries a
random marker (a PCI address no machine has, or a token) so other records of this kernel's log,
and those of earlier runs (they stay in the buffer until overwritten), never confuse it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import signal
import stat
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

from libs.bus import Bus
from libs.bus.server import free_port
from libs.contracts import names
from libs.contracts.remediation import Finding, SignalReport
from services.remediator.main import BUCKETS as REMEDIATOR_BUCKETS

KMSG = "/dev/kmsg"


@contextlib.asynccontextmanager
async def remediation_bus(url: str) -> AsyncIterator[Bus]:
    """The test's own connection (the operator's), with the remediation buckets (signals,
    alerts) open: the daemons never make them."""
    buckets = list(dict.fromkeys([*names.ALL_BUCKETS, *REMEDIATOR_BUCKETS]))
    opened = await Bus.open(url, name="test", buckets=buckets, streams=True)
    try:
        yield opened
    finally:
        await opened.close()


REPO = Path(__file__).resolve().parents[1]


def kmsg_writable() -> str | None:
    """Why the real kernel log cannot be used here, or None when it can."""
    if os.geteuid() != 0:
        return "writing kernel log records needs root"
    try:
        if not stat.S_ISCHR(os.stat(KMSG).st_mode):
            return f"{KMSG} is not the kernel's record device"
    except OSError as error:
        return f"no {KMSG}: {error}"
    if not os.access(KMSG, os.R_OK | os.W_OK):
        return f"{KMSG} is not readable and writable here"
    return None


def write_record(text: str) -> None:
    """One record. A fresh open each time: the kernel rate-limits writes per open file (10 per
    5 s unless printk_devkmsg=on). The newline ends the record: one without it stays open for a
    continuation and no reader sees it until the next record comes."""
    fd = os.open(KMSG, os.O_WRONLY)
    try:
        os.write(fd, (text.rstrip("\n") + "\n").encode())
    finally:
        os.close(fd)


def random_pci() -> str:
    """A PCI address (domain:bus:device) for a marker: a domain no real machine uses."""
    return f"{0xE000 + secrets.randbelow(0x1000):04x}:{secrets.token_hex(1)}:{secrets.token_hex(1)}"


def xid_record(pci: str, xid: int = 79, pid: int = 4242) -> str:
    """An NVRM Xid line as the driver prints it, at error level (`<3>`)."""
    messages = {79: "GPU has fallen off the bus.", 13: "Graphics SM Warp Exception"}
    return f"<3>NVRM: Xid (PCI:{pci}): {xid}, pid={pid}, name=python3, {messages.get(xid, 'x')}"


def finding_for(report: SignalReport | None, pci: str) -> Finding | None:
    if report is None:
        return None
    return next((f for f in report.findings if f.subject == pci), None)


@dataclass
class SignalWatch:
    """Every SignalReport of one node as it lands in `nodus-signals`, stamped on arrival."""

    bus: Bus
    node: str
    seen: list[tuple[float, str, SignalReport]] = field(default_factory=list)
    _task: asyncio.Task[None] | None = None
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def start(self) -> None:
        caught_up = asyncio.Event()
        self._task = asyncio.create_task(self._watch(caught_up))
        waiting = asyncio.create_task(caught_up.wait())
        await asyncio.wait([self._task, waiting], return_when=asyncio.FIRST_COMPLETED)
        if self._task.done():
            waiting.cancel()
            self._task.result()  # the watch failed: say why

    async def _watch(self, caught_up: asyncio.Event) -> None:
        bucket = self.bus.bucket(names.BUCKET_SIGNALS, SignalReport)
        async for change in bucket.watch(f"{self.node}.>", caught_up=caught_up):
            if change.value is not None:
                self.seen.append((time.monotonic(), change.key, change.value))
                self._changed.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    def latest(self, source: str) -> SignalReport | None:
        key = names.signal_key(self.node, source)
        return next((r for _, k, r in reversed(self.seen) if k == key), None)

    async def until(
        self,
        source: str,
        check: Callable[[SignalReport], bool],
        timeout: float,
        after: float = 0.0,
    ) -> tuple[float, SignalReport]:
        """The first report of `source` that arrived after `after` (monotonic) and passes."""
        key = names.signal_key(self.node, source)
        deadline = time.monotonic() + timeout
        while True:
            for at, k, report in self.seen:
                if k == key and at >= after and check(report):
                    return at, report
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {source} report of {self.node} passed within {timeout}s")
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except TimeoutError:
                pass


class MonitorProcess:
    """`python -m app monitor --node NODE --kmsg ...`: the daemon, as systemd starts it."""

    def __init__(
        self,
        url: str,
        node: str,
        machine: Path,
        logs: Path,
        kmsg: str = KMSG,
        cursor: Path | None = None,
        extra: list[str] | None = None,
        reachability: bool = False,
    ) -> None:
        self.url = url
        self.reachability = reachability  # asks its machine's agent whether it answers
        self.node = node
        self.machine = machine
        self.logs = logs
        self.kmsg = kmsg
        self.cursor = cursor or machine / "kmsg-cursor.json"
        self.extra = extra or []
        self.metrics_port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self, npd: str | None = None) -> None:
        self.metrics_port = free_port()
        self.logs.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        output = open(self.logs / f"monitor-{self.node}-{self.starts}.log", "wb")
        environment = {**os.environ, "PYTHONPATH": str(REPO), "NODUS_LOG_FORMAT": "json"}
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "app",
                "monitor",
                "--nats",
                self.url,
                "--node",
                self.node,
                "--kmsg",
                self.kmsg,
                "--kmsg-cursor",
                str(self.cursor),
                "--dcgm",
                str(self.machine / "dcgm.prom"),
                "--npd",
                npd or str(self.machine / "npd.json"),
                "--infiniband",
                str(self.machine / "sys" / "class" / "infiniband"),
                *([] if self.reachability else ["--no-reachability"]),
                "--metrics-port",
                str(self.metrics_port),
                *self.extra,
            ],
            cwd=REPO,
            env=environment,
            stdout=output,
            stderr=subprocess.STDOUT,
        )
        output.close()

    def stop(self) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        code = self.process.returncode
        self.process = None
        return code

    def metric(self, name: str, labels: str = "") -> float:
        """One sample of the monitor's /metrics (0 when absent)."""
        with urllib.request.urlopen(
            f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5
        ) as response:
            text = response.read().decode()
        pattern = re.escape(name) + (re.escape("{" + labels + "}") if labels else "") + r" (\S+)"
        match = re.search(rf"^{pattern}$", text, re.MULTILINE)
        return float(match.group(1)) if match else 0.0

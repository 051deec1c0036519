"""One machine's detector inputs, read from paths that are settings (R1). On a real machine
they are the kernel log file (`/var/log/kern.log`, or `journalctl -kf` written to a file), dcgm-exporter's text at a file or URL, NPD's
conditions and `/sys/class/infiniband`; under `nodus up` they live in `STATE_DIR/machines/NAME/`:
`kmsg`, `dcgm.prom`, `npd.json`, `sys/class/infiniband/...`.

This is the detectors' thin I/O: it reads what changed and hands bytes to the sans-I/O parsers."""

from __future__ import annotations

import os
import urllib.request
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from libs.contracts.remediation import Action, Finding
from services.remediator.catalog import meaning
from services.remediator.detectors.dcgm import Dcgm
from services.remediator.detectors.infiniband import Infiniband, read_ports
from services.remediator.detectors.kmsg import KernelLog
from services.remediator.detectors.npd import NodeProblems

MAX_READ = 4 << 20  # bytes read from one input per scan
SOURCES = ("kmsg", "dcgm", "npd", "infiniband")


@dataclass(frozen=True, slots=True)
class MachinePaths:
    kmsg: str
    dcgm: str  # a path, or an http(s) URL of dcgm-exporter's /metrics
    npd: str
    infiniband: str

    @classmethod
    def under(cls, directory: Path) -> MachinePaths:
        """The layout `nodus up` gives each local machine."""
        return cls(
            kmsg=str(directory / "kmsg"),
            dcgm=str(directory / "dcgm.prom"),
            npd=str(directory / "npd.json"),
            infiniband=str(directory / "sys" / "class" / "infiniband"),
        )

    @classmethod
    def system(cls) -> MachinePaths:
        """A real machine's paths."""
        return cls(
            kmsg="/var/log/kern.log",
            dcgm="http://127.0.0.1:9400/metrics",
            npd="/var/lib/node-problem-detector/conditions.json",
            infiniband="/sys/class/infiniband",
        )


def _read_bytes(path: str) -> bytes | None:
    if path.startswith(("http://", "https://")):
        try:
            with urllib.request.urlopen(path, timeout=2.0) as response:
                data: bytes = response.read(MAX_READ)
                return data
        except OSError:
            return None
    try:
        with open(path, "rb") as file:
            return file.read(MAX_READ)
    except OSError:
        return None


class MachineDetectors:
    """Every in-machine detector of one node, with the state each keeps between scans."""

    def __init__(
        self,
        node: str,
        paths: MachinePaths,
        thermal_fraction: float = 0.2,
        flap_window: timedelta = timedelta(minutes=10),
        flaps: int = 3,
    ) -> None:
        self.node = node
        self.paths = paths
        self.kmsg = KernelLog(node, paths.kmsg)
        self.dcgm = Dcgm(node, paths.dcgm, thermal_fraction)
        self.npd = NodeProblems(node, paths.npd)
        self.infiniband = Infiniband(node, paths.infiniband, flap_window, flaps)
        self._kmsg_at: tuple[int, int] | None = None  # (inode, offset) read so far

    @property
    def malformed(self) -> dict[str, int]:
        return {
            "kmsg": self.kmsg.malformed,
            "dcgm": self.dcgm.malformed,
            "npd": self.npd.malformed,
            "infiniband": self.infiniband.malformed,
        }

    def scan(self, now: datetime) -> dict[str, list[Finding]]:
        return {
            "kmsg": self._scan_kmsg(now),
            "dcgm": self._scan_dcgm(now),
            "npd": self.npd.observe(_read_bytes(self.paths.npd) or b"", now),
            "infiniband": self.infiniband.observe(read_ports(Path(self.paths.infiniband)), now),
        }

    def _scan_dcgm(self, now: datetime) -> list[Finding]:
        data = _read_bytes(self.paths.dcgm)
        return self.dcgm.observe((data or b"").decode("utf-8", errors="replace"), now)

    def _scan_kmsg(self, now: datetime) -> list[Finding]:
        """Reads what was appended; a log that shrank or was replaced started over (a boot)."""
        try:
            with open(self.paths.kmsg, "rb") as file:
                stat = os.fstat(file.fileno())
                inode, offset = self._kmsg_at or (stat.st_ino, 0)
                if inode != stat.st_ino or stat.st_size < offset:
                    self.kmsg.reset()
                    inode, offset = stat.st_ino, 0
                file.seek(offset)
                data = file.read(MAX_READ)
                self._kmsg_at = (inode, offset + len(data))
        except OSError:
            if self._kmsg_at is not None:
                self.kmsg.reset()  # the log is gone: nothing is known about this boot
                self._kmsg_at = None
            return self.kmsg.findings(now)
        self.kmsg.feed(data, now)
        return self.kmsg.findings(now)


def diagnose(node: str, paths: MachinePaths, now: datetime) -> list[Finding]:
    """Diagnostics before a machine or host rejoins (R15): every detector, from scratch, over
    its inputs as they are now. Findings the catalog repairs are failures."""
    scanned = MachineDetectors(node, paths).scan(now)
    failed = []
    for findings in scanned.values():
        for finding in findings:
            action = meaning(finding.kind, finding.subject, finding.xid, finding.detail).action
            if action is not Action.NONE:
                failed.append(finding)
    return failed

"""One machine's detector inputs, read from paths that are settings (R1). On a real machine
they are the kernel's record device `/dev/kmsg` (or a kernel log file such as
`/var/log/kern.log`), dcgm-exporter's text at a file or URL, NPD's conditions and
`/sys/class/infiniband`; under `nodus up` they live in `STATE_DIR/machines/NAME/`: `kmsg` (a
file), `dcgm.prom`, `npd.json`, `sys/class/infiniband/...`.

This is the detectors' thin I/O: it reads what changed and hands bytes to the sans-I/O parsers.
Each source is read on its own (`scan_source`), so a caller can bound each one; the record
device is kmsgdevice.py, a kernel log file is read here as it grows."""

from __future__ import annotations

import logging
import os
import urllib.request
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from pathlib import Path

from libs.contracts.remediation import Action, Finding
from libs.faults.catalog import meaning
from services.monitor.detectors.dcgm import Dcgm
from services.monitor.detectors.infiniband import Infiniband, read_ports
from services.monitor.detectors.kmsg import KernelLog
from services.monitor.detectors.kmsgdevice import KmsgDevice, is_record_device
from services.monitor.detectors.npd import NodeProblems

log = logging.getLogger("nodus.monitor")

MAX_READ = 4 << 20  # bytes read from one input per scan
SOURCES = ("kmsg", "dcgm", "npd", "infiniband")


@dataclass(frozen=True, slots=True)
class MachinePaths:
    kmsg: str
    dcgm: str  # a path, or an http(s) URL of dcgm-exporter's /metrics
    npd: str
    infiniband: str
    # Where a /dev/kmsg reader keeps its place across restarts; None: nowhere (from the start)
    kmsg_cursor: str | None = None

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
            kmsg="/dev/kmsg",
            dcgm="http://127.0.0.1:9400/metrics",
            npd="/var/lib/node-problem-detector/conditions.json",
            infiniband="/sys/class/infiniband",
            kmsg_cursor=default_kmsg_cursor(),
        )


def default_kmsg_cursor() -> str:
    """systemd's StateDirectory= when it gave one, else /var/lib/nodus-monitor."""
    state = os.environ.get("STATE_DIRECTORY", "").split(":")[0] or "/var/lib/nodus-monitor"
    return str(Path(state) / "kmsg-cursor.json")


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
        self._kmsg_device: KmsgDevice | None = None  # when paths.kmsg is the record device
        self._kmsg_error = ""

    @property
    def malformed(self) -> dict[str, int]:
        device = self._kmsg_device.malformed if self._kmsg_device else 0
        return {
            "kmsg": self.kmsg.malformed + device,
            "dcgm": self.dcgm.malformed,
            "npd": self.npd.malformed,
            "infiniband": self.infiniband.malformed,
        }

    def scan(self, now: datetime) -> dict[str, list[Finding]]:
        return {source: self.scan_source(source, now) for source in SOURCES}

    def scan_source(self, source: str, now: datetime) -> list[Finding]:
        """One source's findings now; it may block (a slow URL, a stuck file system)."""
        if source == "kmsg":
            return self._scan_kmsg(now)
        if source == "dcgm":
            return self._scan_dcgm(now)
        if source == "npd":
            return self.npd.observe(_read_bytes(self.paths.npd) or b"", now)
        if source == "infiniband":
            return self.infiniband.observe(read_ports(Path(self.paths.infiniband)), now)
        raise ValueError(f"unknown source {source!r}")

    def kmsg_fileno(self) -> int | None:
        """The open record device, to wait on for new records; None for a file."""
        return self._kmsg_device.fileno() if self._kmsg_device else None

    def close(self) -> None:
        if self._kmsg_device is not None:
            self._kmsg_device.close()

    def _scan_dcgm(self, now: datetime) -> list[Finding]:
        data = _read_bytes(self.paths.dcgm)
        return self.dcgm.observe((data or b"").decode("utf-8", errors="replace"), now)

    def _scan_kmsg(self, now: datetime) -> list[Finding]:
        if self._kmsg_device is None and is_record_device(self.paths.kmsg):
            self._kmsg_device = KmsgDevice(self.paths.kmsg, self.kmsg, self.paths.kmsg_cursor)
        if self._kmsg_device is not None:
            try:
                self._kmsg_device.read(now)
            except OSError as error:
                if str(error) != self._kmsg_error:  # once per cause: every scan would repeat it
                    log.warning("cannot read the kernel log %s: %s", self.paths.kmsg, error)
                    self._kmsg_error = str(error)
            else:
                self._kmsg_error = ""
            return self.kmsg.findings(now)
        return self._scan_kmsg_file(now)

    def _scan_kmsg_file(self, now: datetime) -> list[Finding]:
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
    # From scratch: the whole log of this boot, and the monitor's cursor left alone.
    detectors = MachineDetectors(node, replace(paths, kmsg_cursor=None))
    try:
        scanned = detectors.scan(now)
    finally:
        detectors.close()
    failed = []
    for findings in scanned.values():
        for finding in findings:
            action = meaning(finding.kind, finding.subject, finding.xid, finding.detail).action
            if action is not Action.NONE:
                failed.append(finding)
    return failed

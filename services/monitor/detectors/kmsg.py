"""Kernel log lines: NVIDIA Xid events and GPUs dropping off the PCIe bus (R1).

Reads the lines as `/dev/kmsg` (`6,1234,5678901234,-;NVRM: ...`), `dmesg` (`[ 1234.5] NVRM:
...`) and syslog/journal (`Jan  2 10:11:12 host kernel: NVRM: ...`) write them, and the Xid forms
of old and new drivers:

    NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus.
    NVRM: Xid (PCI:0000:3b:00): 48, pid='<unknown>', name=<unknown>, An uncorrectable ...
    NVRM: Xid (0000:03:00): 79, GPU has fallen off the bus.
    NVRM: Xid (0000:01:00): 13, 0004 00000000 0000a097 ...

`KernelLog` is sans-I/O: feed it bytes as the file grows (or one record's line at a time, from
`/dev/kmsg`), `reset()` it when the log starts over (a new boot), ask it for findings at a given
time. `snapshot()`/`restore()` carry what it found across a monitor restart, so records already
read need not be read again (kmsgdevice.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from libs.contracts.remediation import (
    MAX_EVIDENCE_LINES,
    AlertKind,
    Evidence,
    Finding,
    SeenEvent,
    Severity,
)
from libs.faults.catalog import xid_entry

MAX_LINE = 4096

_XID = re.compile(
    r"NVRM: Xid \((?:PCI:)?(?P<pci>[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-7])?)\):"
    r" *(?P<code>\d{1,5}) *(?:,(?P<rest>.*))?$"
)
_PID = re.compile(r"^ *pid=(?P<pid>'[^']*'|[^,]*) *,(?: *name=(?P<name>[^,]*) *,)?(?P<msg>.*)$")
_PCI = re.compile(r"[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-7])?")
_SLOT_DOWN = re.compile(
    r"pcieport (?P<pci>[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]): pciehp: "
    r"Slot\((?P<slot>[^)]{1,32})\): Link Down"
)
_AER_FATAL = re.compile(
    r"AER: Uncorrected \(Fatal\) error received: (?:id=)?(?P<pci>[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:"
    r"[0-9a-fA-F]{2}\.[0-7])"
)
_KMSG_PREFIX = re.compile(r"^\d{1,3},\d{1,20},(?P<usec>\d{1,20}),[^;]*;")
_DMESG_PREFIX = re.compile(r"^\[ *(?P<sec>\d{1,12}\.\d{1,9})\] ")


@dataclass(frozen=True, slots=True)
class KernelEvent:
    kind: AlertKind
    subject: str  # PCI address of the GPU, or of the port for a PCIe link event
    detail: str
    line: str
    xid: int | None = None
    pid: str | None = None
    process: str | None = None
    kernel_seconds: float | None = None


class Malformed(Exception):
    """A line that claims to be an Xid but does not parse."""


def _kernel_seconds(line: str) -> tuple[float | None, str]:
    kmsg = _KMSG_PREFIX.match(line)
    if kmsg:
        return int(kmsg.group("usec")) / 1e6, line[kmsg.end() :]
    dmesg = _DMESG_PREFIX.match(line)
    if dmesg:
        return float(dmesg.group("sec")), line[dmesg.end() :]
    return None, line


def normalise_pci(address: str) -> str:
    """`0000:3B:00` and `0000:3b:00.0` name one GPU: lower case, no function."""
    address = address.lower()
    return address[:10] if len(address) == 12 and address[10] == "." else address


def may_matter(text: str) -> bool:
    """False when the line cannot be an event (it holds none of the words every event line
    holds, as most kernel lines): skipped without the regular expressions."""
    return (
        "NVRM: Xid" in text
        or "fallen off the bus" in text
        or "pciehp" in text
        or "AER: Uncorrected" in text
    )


def parse_line(line: str) -> KernelEvent | None:
    """One kernel log line: an event, None when it says nothing about GPUs or PCIe; raises
    Malformed when it starts an Xid report it cannot finish."""
    if len(line) > MAX_LINE:
        raise Malformed("line too long")
    if line.startswith(" ") or not may_matter(line):  # ` SUBSYSTEM=pci`: a continuation
        return None
    seconds, message = _kernel_seconds(line.rstrip("\r\n"))
    if "NVRM: Xid" in message:
        match = _XID.search(message)
        if match is None:
            raise Malformed("unparsable Xid line")
        code = int(match.group("code"))
        rest = (match.group("rest") or "").strip()
        pid = process = None
        described = _PID.match(rest)
        if described:
            pid = described.group("pid").strip().strip("'")
            process = (described.group("name") or "").strip() or None
            rest = described.group("msg").strip()
        return KernelEvent(
            kind=AlertKind.XID,
            subject=normalise_pci(match.group("pci")),
            detail=rest or xid_entry(code).name,
            line=line.strip(),
            xid=code,
            pid=pid,
            process=process,
            kernel_seconds=seconds,
        )
    off_bus = message.find("fallen off the bus")
    if off_bus >= 0:
        match = _PCI.search(message, 0, off_bus)
        if match:
            return KernelEvent(
                AlertKind.GPU_OFF_BUS,
                normalise_pci(match.group(0)),
                "GPU has fallen off the bus",
                line.strip(),
                kernel_seconds=seconds,
            )
        return None
    slot = _SLOT_DOWN.search(message)
    if slot:
        return KernelEvent(
            AlertKind.GPU_OFF_BUS,
            normalise_pci(slot.group("pci")),
            f"PCIe slot {slot.group('slot')} link down",
            line.strip(),
            kernel_seconds=seconds,
        )
    aer = _AER_FATAL.search(message)
    if aer:
        return KernelEvent(
            AlertKind.GPU_OFF_BUS,
            normalise_pci(aer.group("pci")),
            "PCIe uncorrected fatal error",
            line.strip(),
            kernel_seconds=seconds,
        )
    return None


@dataclass(slots=True)
class _Seen:
    event: KernelEvent
    first: datetime
    last: datetime
    count: int = 0
    lines: list[str] = field(default_factory=list)


class KernelLog:
    """Follows one machine's kernel log. Hardware faults stay found until the log starts over
    (a reboot); faults the catalog calls application errors expire `transient` after their last
    line, so their alerts clear on their own."""

    def __init__(self, node: str, where: str, transient: timedelta = timedelta(minutes=15)) -> None:
        self.node = node
        self.where = where
        self.transient = transient
        self.malformed = 0
        self.events = 0  # events fed so far (a reader saves its cursor when this moves)
        self._partial = b""
        self._seen: dict[tuple[AlertKind, str, int | None], _Seen] = {}

    def reset(self) -> None:
        """The log started over: a new boot."""
        self._partial = b""
        self._seen.clear()

    def feed(self, data: bytes, now: datetime) -> None:
        """Bytes appended to the log since the last feed; a partial last line waits."""
        data = self._partial + data
        *lines, self._partial = data.split(b"\n")
        if len(self._partial) > MAX_LINE:
            self._partial = b""
            self.malformed += 1
        for raw in lines:
            self.feed_line(raw.decode("utf-8", errors="replace"), now)

    def snapshot(self) -> list[SeenEvent]:
        return [
            SeenEvent(
                kind=s.event.kind,
                subject=s.event.subject,
                detail=s.event.detail,
                line=s.event.line,
                xid=s.event.xid,
                pid=s.event.pid,
                process=s.event.process,
                kernel_seconds=s.event.kernel_seconds,
                first=s.first,
                last=s.last,
                count=s.count,
                lines=list(s.lines),
            )
            for s in self._seen.values()
        ]

    def restore(self, events: list[SeenEvent]) -> None:
        """What an earlier reader of this boot's log found (its `snapshot()`)."""
        self.reset()
        for e in events:
            event = KernelEvent(
                e.kind, e.subject, e.detail, e.line, e.xid, e.pid, e.process, e.kernel_seconds
            )
            seen = _Seen(event, e.first, e.last, e.count, e.lines[-MAX_EVIDENCE_LINES:])
            self._seen[(event.kind, event.subject, event.xid)] = seen

    def feed_line(self, line: str, now: datetime) -> None:
        """One whole line, seen at `now` (for /dev/kmsg: when the kernel logged it)."""
        try:
            event = parse_line(line)
        except Malformed:
            self.malformed += 1
            return
        if event is None:
            return
        self.events += 1
        key = (event.kind, event.subject, event.xid)
        seen = self._seen.get(key)
        if seen is None:
            seen = self._seen[key] = _Seen(event, now, now)
        seen.last = max(seen.last, now)
        seen.count += 1
        seen.event = event
        seen.lines = [*seen.lines, event.line][-MAX_EVIDENCE_LINES:]

    def findings(self, now: datetime) -> list[Finding]:
        result = []
        for key, seen in list(self._seen.items()):
            severity, transient = self._severity(seen.event)
            if transient and now - seen.last > self.transient:
                del self._seen[key]
                continue
            event = seen.event
            labels = {"pci": event.subject}
            if event.pid:
                labels["pid"] = event.pid
            if event.process:
                labels["process"] = event.process
            values: dict[str, float] = {"count": float(seen.count)}
            if event.kernel_seconds is not None:
                values["kernelSeconds"] = event.kernel_seconds
            result.append(
                Finding(
                    kind=event.kind,
                    subject=event.subject,
                    severity=severity,
                    detail=event.detail,
                    xid=event.xid,
                    evidence=Evidence(
                        kind=event.kind,
                        source="kmsg",
                        node=self.node,
                        where=self.where,
                        observed_time=seen.last,
                        severity=severity,
                        lines=list(seen.lines),
                        values=values,
                        labels=labels,
                        xid=event.xid,
                    ),
                )
            )
        return result

    @staticmethod
    def _severity(event: KernelEvent) -> tuple[Severity, bool]:
        if event.xid is None:
            return "critical", False
        entry = xid_entry(event.xid, event.detail)
        return entry.severity, entry.transient

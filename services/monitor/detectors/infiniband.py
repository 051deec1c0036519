"""InfiniBand rails from sysfs, seen from the host side (R1): each port's `state`
(`4: ACTIVE`), `phys_state` (`5: LinkUp`) and `counters/link_downed`, under a root such as
`/sys/class/infiniband/<device>/ports/<port>/`. A port not active is down; a `link_downed`
counter that climbs by `flaps` or more within `window` is a flapping link.

`read_ports(root)` is the only I/O; `Infiniband.observe(ports, now)` is pure."""

from __future__ import annotations

import re
from collections import deque
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from libs.contracts.remediation import AlertKind, Evidence, Finding, Severity

_STATE = re.compile(r"^\s*(\d{1,3})\s*:\s*([A-Za-z_ ]{1,32}?)\s*$")
MAX_READ = 256


@dataclass(frozen=True, slots=True)
class PortSample:
    device: str
    port: str
    state: str | None  # the file's raw text; None when missing
    phys_state: str | None
    link_downed: str | None

    @property
    def subject(self) -> str:
        return f"{self.device}/{self.port}"


def _read(path: Path) -> str | None:
    try:
        with open(path, "rb") as file:
            return file.read(MAX_READ).decode("utf-8", errors="replace")
    except OSError:
        return None


def read_ports(root: Path) -> list[PortSample]:
    """Every `<root>/<device>/ports/<port>` directory; unreadable files come back as None."""
    samples = []
    try:
        devices = sorted(p for p in root.iterdir() if p.is_dir())
    except OSError:
        return []
    for device in devices:
        try:
            ports = sorted(p for p in (device / "ports").iterdir() if p.is_dir())
        except OSError:
            continue
        for port in ports:
            samples.append(
                PortSample(
                    device=device.name[:64],
                    port=port.name[:16],
                    state=_read(port / "state"),
                    phys_state=_read(port / "phys_state"),
                    link_downed=_read(port / "counters" / "link_downed"),
                )
            )
    return samples


class Malformed(Exception):
    pass


def parse_state(text: str) -> tuple[int, str]:
    """`4: ACTIVE` -> (4, "ACTIVE")."""
    match = _STATE.match(text)
    if match is None:
        raise Malformed(f"not a port state: {text[:40]!r}")
    return int(match.group(1)), match.group(2).strip()


def parse_counter(text: str) -> int:
    stripped = text.strip()
    if not stripped.isdigit() or len(stripped) > 20:
        raise Malformed(f"not a counter: {text[:40]!r}")
    return int(stripped)


class Infiniband:
    def __init__(
        self,
        node: str,
        where: str,
        window: timedelta = timedelta(minutes=10),
        flaps: int = 3,
    ) -> None:
        self.node = node
        self.where = where
        self.window = window
        self.flaps = flaps
        self.malformed = 0
        self._history: dict[str, deque[tuple[datetime, int]]] = {}

    def observe(self, ports: list[PortSample], now: datetime) -> list[Finding]:
        findings = []
        for port in ports:
            findings.extend(self._port(port, now))
        return findings

    def _port(self, port: PortSample, now: datetime) -> list[Finding]:
        found: list[Finding] = []
        lines = []
        down = False
        values: dict[str, float] = {}
        try:
            if port.state is not None:
                number, name = parse_state(port.state)
                values["state"] = number
                lines.append(f"state: {port.state.strip()}")
                down |= name.upper() != "ACTIVE"
            if port.phys_state is not None:
                number, name = parse_state(port.phys_state)
                values["physState"] = number
                lines.append(f"phys_state: {port.phys_state.strip()}")
                down |= name.replace(" ", "").lower() != "linkup"
        except Malformed:
            self.malformed += 1
            return []
        where = f"{self.where}/{port.device}/ports/{port.port}"
        if down:
            found.append(
                self._finding(AlertKind.INFINIBAND_PORT_DOWN, port, where, lines, values, now)
            )
        if port.link_downed is not None:
            try:
                count = parse_counter(port.link_downed)
            except Malformed:
                self.malformed += 1
                return found
            history = self._history.setdefault(port.subject, deque())
            if history and count < history[-1][1]:
                history.clear()  # the counter was reset (a reboot or a driver reload)
            history.append((now, count))
            while len(history) > 1 and now - history[1][0] >= self.window:
                history.popleft()
            climbed = count - history[0][1]
            if climbed >= self.flaps:
                found.append(
                    self._finding(
                        AlertKind.INFINIBAND_FLAPPING,
                        port,
                        where,
                        [
                            *lines,
                            f"counters/link_downed: {count} (+{climbed} within {self.window})",
                        ],
                        {**values, "linkDowned": count, "linkDownedDelta": climbed},
                        now,
                    )
                )
        return found

    def _finding(
        self,
        kind: AlertKind,
        port: PortSample,
        where: str,
        lines: list[str],
        values: dict[str, float],
        now: datetime,
    ) -> Finding:
        severity: Severity = "critical" if kind is AlertKind.INFINIBAND_PORT_DOWN else "warning"
        return Finding(
            kind=kind,
            subject=port.subject,
            severity=severity,
            detail="; ".join(lines),
            evidence=Evidence(
                kind=kind,
                source="infiniband",
                node=self.node,
                where=where,
                observed_time=now,
                severity=severity,
                lines=lines,
                values=values,
                labels={"device": port.device, "port": port.port},
            ),
        )

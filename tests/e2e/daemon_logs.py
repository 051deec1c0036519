"""After an end-to-end test no daemon log holds an error (DESIGN.md, Testing; issue 9 item 6).

`DaemonLogs` watches log directories (STATE_DIR/logs of a LocalSystem or a `nodus up`) and
returns what was appended since it last looked that a user would call a failure:

- a JSON line whose `level` is `error` or `critical`;
- any line (JSON or not) that holds `Unhandled exception` or `Traceback`; a raw traceback
  (a daemon that died printing to stderr) is taken with the indented lines that follow it.

A finding is allowed when one of the test's patterns (`re.search`) matches its message (the
`msg` of a JSON line, else the text). Only whole lines count: a line being written is read next
time.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

ERROR_LEVELS = {"error", "critical", "fatal"}
MARKERS = ("Unhandled exception", "Traceback")


@dataclass(frozen=True)
class Finding:
    path: Path
    line: int  # 1-based line number of the first line in its file
    message: str  # what the allow-list is matched against
    text: str  # the line(s) as written, for the failure message

    def __str__(self) -> str:
        """One line: where, the level, the message's first line and the exception's last."""
        try:
            record = json.loads(self.text)
        except ValueError:
            record = None
        if isinstance(record, dict):
            message = str(record.get("msg", "")).splitlines() or [""]
            exc = str(record.get("exc", "")).strip().splitlines()
            shown = f"[{record.get('level')}] {message[0]}" + (f" | {exc[-1]}" if exc else "")
        else:
            lines = self.text.strip().splitlines()
            shown = lines[0] + (f" ... {lines[-1]}" if len(lines) > 1 else "")
        shown = shown if len(shown) <= 400 else shown[:400] + " ..."
        return f"{self.path.name}:{self.line}: {shown}"


@dataclass
class _Position:
    offset: int = 0
    line: int = 0


def _finding(path: Path, number: int, line: str) -> Finding | None:
    try:
        record = json.loads(line)
    except ValueError:
        record = None
    if isinstance(record, dict):
        level = str(record.get("level", "")).lower()
        message = str(record.get("msg", ""))
        if level in ERROR_LEVELS or any(marker in line for marker in MARKERS):
            return Finding(path, number, message, line)
        return None
    if any(marker in line for marker in MARKERS):
        return Finding(path, number, line.strip(), line)
    return None


def scan_text(path: Path, text: str, first_line: int = 1) -> list[Finding]:
    """The findings in whole lines of `text` (line numbers from `first_line`)."""
    findings: list[Finding] = []
    lines = text.splitlines()
    index = 0
    while index < len(lines):
        line = lines[index]
        found = _finding(path, first_line + index, line)
        index += 1
        if found is None:
            continue
        if "Traceback" in line and not line.lstrip().startswith("{"):
            # A raw traceback: its frames are indented; the exception line ends it.
            block = [line]
            while index < len(lines) and (lines[index].startswith((" ", "\t")) or not lines[index]):
                block.append(lines[index])
                index += 1
            if index < len(lines):
                block.append(lines[index])
                index += 1
            text_block = "\n".join(block)
            found = Finding(path, found.line, text_block, text_block)
        findings.append(found)
    return findings


@dataclass
class DaemonLogs:
    """Log directories being watched and how far each file has been read."""

    directories: list[Path] = field(default_factory=list)
    _positions: dict[Path, _Position] = field(default_factory=dict)

    def watch(self, directory: Path) -> None:
        """Watch `directory/*.log` from the start of every file (even one already there)."""
        directory = directory.resolve()
        if directory not in self.directories:
            self.directories.append(directory)

    def files(self) -> list[Path]:
        return sorted(p for d in self.directories if d.is_dir() for p in d.glob("*.log"))

    def read_new(self) -> list[Finding]:
        """Findings in what was appended to the watched logs since the last call."""
        findings: list[Finding] = []
        for path in self.files():
            position = self._positions.setdefault(path, _Position())
            with open(path, "rb") as handle:
                handle.seek(position.offset)
                data = handle.read()
            end = data.rfind(b"\n") + 1  # whole lines only
            if end == 0:
                continue
            text = data[:end].decode(errors="replace")
            findings += scan_text(path, text, position.line + 1)
            position.offset += end
            position.line += text.count("\n")
        return findings


def disallowed(findings: Iterable[Finding], allowed: Iterable[str]) -> list[Finding]:
    patterns = [re.compile(p) for p in allowed]
    return [f for f in findings if not any(p.search(f.message) for p in patterns)]


def report(findings: list[Finding], where: str) -> str:
    shown = "\n".join(f"  {f}" for f in findings[:20])
    more = f"\n  ... and {len(findings) - 20} more" if len(findings) > 20 else ""
    return (
        f"{len(findings)} error(s) in daemon logs {where} (allow one with "
        f"@pytest.mark.daemon_logs_allow(r'pattern') only where the error is the point):\n"
        f"{shown}{more}"
    )

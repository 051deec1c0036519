"""The end-to-end tests' daemon-log check (tests/e2e/daemon_logs.py) on written logs."""

from __future__ import annotations

import json
from pathlib import Path

from tests.e2e.daemon_logs import DaemonLogs, disallowed


def line(level: str, msg: str, **extra: str) -> str:
    return json.dumps({"level": level, "service": "agent", "msg": msg, **extra}) + "\n"


def test_errors_unhandled_exceptions_and_tracebacks_are_found_once(tmp_path: Path) -> None:
    logs = DaemonLogs()
    logs.watch(tmp_path)
    log = tmp_path / "agent-a.log"
    log.write_text(line("info", "started") + line("warning", "relay relay-0 lost"))
    assert logs.read_new() == []
    with open(log, "a") as handle:
        handle.write(line("error", "cannot start: no relay"))
        handle.write(line("info", "Unhandled exception in client_connected_cb"))
        handle.write(line("warning", "odd", exc="Traceback (most recent call last):\n  ..."))
        handle.write("Traceback (most recent call last):\n  File 'x', line 1\nRuntimeError: boom\n")
        handle.write(line("critical", "half a line")[:20])  # still being written
    found = logs.read_new()
    assert [f.line for f in found] == [3, 4, 5, 6]
    assert found[0].message == "cannot start: no relay"
    assert found[3].message.endswith("RuntimeError: boom")
    assert logs.read_new() == []  # already reported
    with open(log, "a") as handle:
        handle.write(line("critical", "half a line")[20:])
    assert [f.message for f in logs.read_new()] == ["half a line"]


def test_the_allow_list_matches_messages(tmp_path: Path) -> None:
    logs = DaemonLogs()
    logs.watch(tmp_path)
    (tmp_path / "relay-0.log").write_text(
        line("error", "member lam-b refused: bad proof") + line("error", "disk full")
    )
    left = disallowed(logs.read_new(), [r"refused: bad proof$"])
    assert [f.message for f in left] == ["disk full"]


def test_a_finding_reads_as_one_line(tmp_path: Path) -> None:
    logs = DaemonLogs()
    logs.watch(tmp_path)
    exc = "Traceback (most recent call last):\n  File 'relay.py'\nRuntimeError: handler is closed"
    (tmp_path / "relay-0.log").write_text(
        line("error", "Unhandled exception\ntransport: x", exc=exc)
    )
    (found,) = logs.read_new()
    assert str(found) == (
        "relay-0.log:1: [error] Unhandled exception | RuntimeError: handler is closed"
    )

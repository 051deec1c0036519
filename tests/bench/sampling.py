"""What the benches read from /proc (Linux): a process's CPU, its descendants, how busy the
whole machine was. Cheap enough to run inside a measuring window."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")


def machine_busy() -> float:
    """CPU seconds every CPU of this machine has spent not idle (all processes, ours too)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / CLK_TCK


def stat(pid: int) -> list[str] | None:
    """/proc/PID/stat from field 3 (state) on; None once the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()


def started(pid: int) -> str | None:
    """The process's start time: tells a reused pid apart."""
    fields = stat(pid)
    return fields[19] if fields is not None else None


def process_cpu(pid: int) -> float | None:
    """CPU seconds (user + system) of one process; None once it is gone."""
    fields = stat(pid)
    return (int(fields[11]) + int(fields[12])) / CLK_TCK if fields is not None else None


def descendants(roots: list[int]) -> list[int]:
    """The roots and every live process below them (one pass over /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = stat(int(entry))
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], list(roots)
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def written_bytes(pid: int) -> int:
    """Bytes the process has written (to sockets, files, pipes) since it started; 0 once gone."""
    try:
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            if line.startswith("wchar:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


def is_dataplane(pid: int) -> bool:
    """A member's dataplane process (`python -m services.agent.dataplane`)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"services.agent.dataplane" in args


def cpu_seconds(groups: dict[str, list[int]], tree: bool = False) -> dict[str, float]:
    """CPU (user + system) of each group of processes; with `tree`, of their live
    descendants too (socat forks a child per connection)."""
    return {
        name: sum(process_cpu(pid) or 0.0 for pid in (descendants(roots) if tree else roots))
        for name, roots in groups.items()
    }


def spawned_below(roots: list[int]) -> list[tuple[int, str | None]]:
    """Every live process below the roots, with its start time: what `kill_left_behind`
    stops later if it is still there."""
    return [(pid, started(pid)) for pid in descendants(roots) if pid not in roots]


def kill_left_behind(spawned: list[tuple[int, str | None]]) -> None:
    """SIGKILL those of `spawned` still running: by pid, and only the very processes seen
    (a pid reused since belongs to someone else)."""
    for pid, since in spawned:
        if since is not None and started(pid) == since:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def idle_cores(seconds: float = 1.0) -> float:
    """How many of this machine's CPUs sat idle over the next `seconds` (sleeps that long)."""
    import time

    before, started = machine_busy(), time.monotonic()
    time.sleep(seconds)
    busy = (machine_busy() - before) / (time.monotonic() - started)
    return max(0.0, (os.cpu_count() or 1) - busy)

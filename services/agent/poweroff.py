"""A lab machine powers off: every process its boot left running ends (O4). On a real machine
the kernel does this; the lab's machines share one kernel, so `nodus up` stopping (or a test's
system) ends each machine's ranks and epoch dataplanes itself, which its agents, stopped as an
upgrade stops them, leave running."""

from __future__ import annotations

from pathlib import Path

from services.agent import procs
from services.agent.dataplane.store import EpochStore
from services.agent.ranks import kill_remembered


def power_off(state_dir: Path) -> int:
    """Kill the ranks and dataplane processes recorded in a machine's state directory that
    still run; returns how many."""
    killed = kill_remembered(state_dir / "logs")
    for stored in EpochStore(state_dir).load_all():
        if stored.process is not None:
            killed += procs.kill_group(stored.process.pid, stored.process.start_ticks)
    return killed

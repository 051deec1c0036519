"""The probe's client starts as a process for every pair of every round of a gang's probe:
it imports the standard library only (the daemon helpers cost it 140 ms, an 8-member probe
6 s)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_probe_client_imports_nothing_but_the_standard_library() -> None:
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, services.agent.probe; print(*sorted(sys.modules))"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    heavy = [n for n in loaded if n.split(".")[0] in ("libs", "nats", "msgspec", "uvloop")]
    assert heavy == [], heavy

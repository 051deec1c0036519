"""The `nodus` command as a user runs it, from the tests: the console script of this venv."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from app.local import REPO

NODUS = str(Path(sys.executable).parent / "nodus")


def nodus(*args: str, timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
    """`nodus ARGS...` in the repository, its output captured; bounded."""
    return subprocess.run(
        [NODUS, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO, check=False
    )

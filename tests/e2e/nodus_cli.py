"""The `nodus` command as a user runs it, from the tests: the console script of this venv."""

from __future__ import annotations

import os
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


def nodus_on(
    url: str, *args: str, check: bool = True, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`nodus ARGS...` against the bus at `url`, as an operator runs it (with `env` added);
    with `check`, it must succeed."""
    result = subprocess.run(
        [NODUS, *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={**os.environ, "NODUS_NATS_URL": url, **(env or {})},
        check=False,
    )
    if check:
        assert result.returncode == 0, f"nodus {' '.join(args)}: {result.stderr}"
    return result

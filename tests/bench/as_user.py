"""A bench run the way the README shows it: `python -m tests.bench.NAME FLAGS` from the
project's root in a plain environment (no operator credentials: the bench makes its own), its
JSON read from stdout and recorded among the run's figures (tests/figures.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from libs.bus.connection import CREDENTIAL_VARIABLES
from tests import figures


def plain_environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in CREDENTIAL_VARIABLES}


def run_bench(name: str, flags: list[str], timeout: float) -> dict[str, Any]:
    """The bench's JSON (whatever its exit code: the JSON says why it failed)."""
    done = subprocess.run(
        [sys.executable, "-m", f"tests.bench.{name}", *flags],
        cwd=figures.ROOT,
        env=plain_environment(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    try:
        result: dict[str, Any] = json.loads(done.stdout)
    except json.JSONDecodeError:
        raise AssertionError(
            f"tests.bench.{name} exited {done.returncode} without its JSON:\n"
            f"{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        ) from None
    figures.record(name, result)
    return result

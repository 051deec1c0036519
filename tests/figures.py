"""The figures a test run measured (each bench smoke test's JSON), written at the end of the
run to `.nodus/figures.json` and printed, so the CI log of every run carries them and a trend
can be read across runs."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
FILE = ROOT / ".nodus" / "figures.json"

measured: dict[str, Any] = {}


def record(name: str, figures: Any) -> None:
    measured[name] = figures


def write() -> str | None:
    """The figures as JSON, written to FILE; None when the run measured none."""
    if not measured:
        return None
    document = {
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release()},
        "figures": measured,
    }
    text = json.dumps(document, indent=1, sort_keys=True, default=str)
    FILE.parent.mkdir(parents=True, exist_ok=True)
    FILE.write_text(text + "\n")
    return text

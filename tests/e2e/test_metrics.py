"""O2: every daemon `nodus up` starts serves /metrics, listed in STATE_DIR/prometheus/targets.json
with a `job` label per kind of daemon, and Debian's Prometheus (`nodus up --prometheus`)
scrapes every one of them: each target is up, and nodus_ series of every kind are there."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from app.local import LocalSystem
from libs.bus.server import free_port

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("prometheus") is None, reason="deploy/dev/system-deps.sh"),
]

KINDS = {"placer", "runner", "relay", "agent", "remediator", "monitor"}


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as answer:
        return json.loads(answer.read())


def test_every_daemon_is_a_target_and_prometheus_scrapes_them_all(tmp_path: Path) -> None:
    system = LocalSystem(
        state_dir=tmp_path / "state",
        nats_port=free_port(),
        heartbeat_seconds=1.0,
        prometheus=True,
    )
    try:
        asyncio.run(system.start(timeout=90))
        groups = json.loads((tmp_path / "state" / "prometheus" / "targets.json").read_text())
        assert {g["labels"]["job"] for g in groups} == KINDS
        assert len(groups) == len(system.metrics_ports) == len(system.children) - 1
        for group in groups:  # each answers, in Prometheus's text format
            [target] = group["targets"]
            with urllib.request.urlopen(f"http://{target}/metrics", timeout=5) as answer:
                assert b"# TYPE" in answer.read(), group
        api = f"http://127.0.0.1:{system.prometheus_port}/api/v1"
        deadline = time.monotonic() + 60
        while True:
            try:
                active = _get(f"{api}/targets")["data"]["activeTargets"]
            except OSError:
                active = []
            healthy = {t["labels"]["daemon"] for t in active if t["health"] == "up"}
            if len(healthy) == len(groups):
                break
            assert time.monotonic() < deadline, (
                f"not every target up after 60 s: {[(t['labels'], t['health'], t['lastError']) for t in active]}"
            )
            time.sleep(1)
        query = urllib.parse.quote('count by (job) ({__name__=~"nodus_.+"})')
        result = _get(f"{api}/query?query={query}")["data"]["result"]
        assert {r["metric"]["job"] for r in result} == KINDS, result
    finally:
        system.stop()

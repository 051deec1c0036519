"""The runner was the prober until this release: where operators type the old names (the
command, the systemd unit, the metrics), they still work until the next one."""

from __future__ import annotations

import configparser
import subprocess
import sys

from app.local import REPO
from services.runner import metrics


def test_nodus_prober_still_starts_the_runner_and_says_it_is_deprecated() -> None:
    listed = subprocess.run(
        [sys.executable, "-m", "app", "--help"], capture_output=True, text=True, cwd=REPO
    )
    assert "runner's old name" in listed.stdout, listed.stdout
    old = subprocess.run(
        [sys.executable, "-m", "app", "prober", "--help"], capture_output=True, text=True, cwd=REPO
    )
    new = subprocess.run(
        [sys.executable, "-m", "app", "runner", "--help"], capture_output=True, text=True, cwd=REPO
    )
    assert old.returncode == new.returncode == 0, old.stderr
    assert "--sample-seconds" in old.stdout and "--takeover-seconds" in old.stdout


def test_the_runners_metrics_are_exported_under_their_old_names_with_the_same_values() -> None:
    metrics.RUNS.labels("succeeded").inc()
    new = {s.name: s for m in [metrics.RUNS] for f in m.collect() for s in f.samples}
    old = {s.name: s for f in metrics._OldNames().collect() for s in f.samples}
    assert old["nodus_prober_runs_total"].value == new["nodus_runner_runs_total"].value >= 1
    names = {f.name for f in metrics._OldNames().collect()}
    assert {"nodus_prober_jobs", "nodus_prober_probes", "nodus_prober_probe_seconds"} <= names
    assert not [n for n in names if "runner" in n]


def test_the_old_systemd_unit_name_is_an_alias_of_the_runners() -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read(REPO / "deploy" / "systemd" / "nodus-runner.service")
    assert unit["Install"]["Alias"] == "nodus-prober.service"
    assert "nodus runner" in unit["Service"]["ExecStart"]

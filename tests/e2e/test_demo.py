"""`nodus demo` is the main job end to end: it must finish with exit 0 and show what it claims."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from app.demo import lab_unavailable
from tests.e2e.daemon_logs import DaemonLogs

pytestmark = pytest.mark.slow


def test_demo_places_one_gang_per_path_runs_the_workload_and_shows_refusals(
    tmp_path: Path, daemon_logs: DaemonLogs
) -> None:
    nodus = str(Path(sys.executable).parent / "nodus")
    state = tmp_path / "state"
    daemon_logs.watch(state / "logs")
    result = subprocess.run(
        [nodus, "demo", "--state-dir", str(state)], capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "3 gangs placed (direct, private, relayed)" in out
    for reason in (
        "DistributedAccessDenied",
        "LdPreloadWithAuto",
        "RelayedMemberLimit",
        "BackendMismatch",
    ):
        assert reason in out
    assert "NODUS_GANG_TRANSPORT=relayed" in out and "LD_PRELOAD=" in out
    assert "stopped everything" in out
    # The embedded default: the Direct gang is shown placed only (`nodus demo --netns` runs it).
    assert "the Direct gang will be shown placed only" in out
    assert "the workload ran on the private, the relayed gang, verified on every rank" in out
    assert out.count('"verified": true') == 4
    assert '"path":"derp:' in out and "Succeeded" in out


def test_demo_runs_on_a_three_server_nats_cluster(tmp_path: Path, daemon_logs: DaemonLogs) -> None:
    """`nodus demo --nats-cluster 3`: the same jobs on three clustered nats-servers whose
    streams and buckets keep three copies."""
    nodus = str(Path(sys.executable).parent / "nodus")
    state = tmp_path / "state"
    daemon_logs.watch(state / "logs")
    result = subprocess.run(
        [nodus, "demo", "--nats-cluster", "3", "--state-dir", str(state)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    url = next(line for line in out.splitlines() if line.startswith("NODUS_NATS_URL="))
    assert url.count("nats://") == 3
    assert sorted(p.name for p in (state / "nats").iterdir() if p.name.startswith("n")) == [
        "n0",
        "n1",
        "n2",
    ]
    assert "the workload ran on the private, the relayed gang, verified on every rank" in out


@pytest.mark.skipif(lab_unavailable() is not None, reason=str(lab_unavailable()))
def test_demo_in_the_lab_runs_the_direct_gang_over_nodus0_beside_private_and_relayed(
    tmp_path: Path, daemon_logs: DaemonLogs
) -> None:
    """What `make demo` runs as root: every machine in a namespace of its own, the Direct gang
    probed `direct` and Succeeded, with no error in any daemon's log."""
    nodus = str(Path(sys.executable).parent / "nodus")
    state = tmp_path / "state"
    daemon_logs.watch(state / "logs")
    result = subprocess.run(
        [nodus, "demo", "--netns", "--state-dir", str(state)],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "the workload ran on the direct, the private, the relayed gang" in out
    assert out.count('"verified": true') == 8
    assert '"path":"direct"' in out and '"path":"derp:' in out

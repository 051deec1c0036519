"""The gang bench still runs: a --quick run completes and reports every figure from measured
values. Behaviour only; the bench reports speed, this test never judges it."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import figures
from tests.bench.as_user import plain_environment, run_bench


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_quick_bench_completes_with_every_figure() -> None:
    result = run_bench("gang", ["--quick"], timeout=380)
    assert "error" not in result, result.get("error")

    probes = {p["members"]: p for p in result["probe"]}
    assert set(probes) == {2, 4}
    for members, probe in probes.items():
        assert probe["rounds"] == members // 2
        assert probe["pairs"] == members * (members - 1) // 2
        assert len(probe["perRound"]) == probe["rounds"]
        assert probe["minimumSeconds"] >= probe["rounds"] * probe["sampleSeconds"]
        assert probe["probeWallSeconds"] > 0 and probe["roundsWallSeconds"] > 0
        assert probe["slowestPair"]["path"] == "direct"

    startup = result["relayedStartup"]
    for key in (
        "placementSeconds",
        "joinSeconds",
        "probeSeconds",
        "launchSeconds",
        "applyToRunningSeconds",
    ):
        assert startup[key] is not None and startup[key] >= 0, (key, startup)
    assert startup["probe"]["path"].startswith("derp:")

    allreduce = result["allreduce"]
    for path in ("relayed", "loopback"):
        assert len(allreduce[path]["ranks"]) == 2
        assert all(rank["verified"] is True for rank in allreduce[path]["ranks"])
        assert allreduce[path]["busGbps"] > 0
    assert allreduce["relayedOverLoopback"] is not None
    assert result["relayedBilling"]["usageRelayBytesAfterwards"] > 0


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_bench_stopped_by_sigterm_leaves_nothing_running() -> None:
    """SIGTERM mid-run (a CI timeout, `kill`): the bench says it was stopped, prints its
    JSON and no process it started (nats-server, daemons, agents) outlives it."""
    bench = subprocess.Popen(
        [sys.executable, "-m", "tests.bench.gang", "--quick", "--keep-state"],
        cwd=figures.ROOT,
        env=plain_environment(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert bench.stderr is not None
        for line in bench.stderr:  # the system is up and the probes run: stop it there
            if "probe" in line.lower() or "members" in line:
                break
        time.sleep(3)
        bench.send_signal(signal.SIGTERM)
        out, _ = bench.communicate(timeout=90)
    finally:
        if bench.poll() is None:
            bench.kill()
    result = json.loads(out)
    assert "stopped by SIGTERM" in result["error"], result
    state = result["state"]
    left = [
        entry.name
        for entry in Path("/proc").iterdir()
        if entry.name.isdigit() and state.encode() in _cmdline(entry)
    ]
    assert left == [], f"processes of {state} still run: {left}"


def _cmdline(entry: Path) -> bytes:
    try:
        return (entry / "cmdline").read_bytes()
    except OSError:
        return b""

"""The connect bench still runs: a short run measures connects through the shim and direct on
a live Relayed path, stops the peer's agent and reports how the connects on the dead path
ended (killed at a short cap if they had not). Behaviour only; the bench reports latency and
errnos, this test never judges them."""

from __future__ import annotations

import pytest

from tests.bench import connect
from tests.bench.as_user import run_bench


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_short_bench_measures_live_and_dead_paths() -> None:
    result = run_bench(
        "connect",
        ["--connects", "40", "--rounds", "2", "--dead", "2", "--modes", "stop", "--cap", "3"],
        timeout=280,
    )
    assert "error" not in result, result.get("error")
    stop = result["modes"]["stop"]
    for path in ("direct", "shim"):
        figures = stop["live"][path]
        assert figures["n"] + figures["failures"] == 40
    assert stop["live"]["echo_through_shim"]["result"] == "ok"
    dead = stop["dead"]
    for wave in ("at_once", f"after_{connect.LATER:g}s"):
        blocking = dead[wave]["blocking"]
        assert blocking["n"] == 2 and len(blocking["samples"]) == 2
        for sample in [*blocking["samples"], dead[wave]["python_settimeout"]]:
            assert sample["seconds"] > 0
            assert sample["returned"] or sample["seconds"] >= 3
    assert "recovered_after_cont_s" in dead
    assert set(result["summary"]["dead"]) == {"stop"}

"""The slow-receiver bench still runs: a --quick run completes, measures gang 2 in every phase
of both configurations and reports the ratios. Behaviour only; the bench reports how much a
stalled member slows the other gang, this test never judges it."""

from __future__ import annotations

import pytest

from tests.bench.as_user import run_bench
from tests.bench.slow_receiver_experiment import PHASES


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_quick_bench_measures_every_phase() -> None:
    result = run_bench("slow_receiver", ["--quick"], timeout=220)
    assert "error" not in result, result.get("error")
    assert set(result["configs"]) == {"capped", "uncapped"}
    for config in result["configs"].values():
        phases = config["phases"]
        assert list(phases) == list(PHASES)
        # Gang 2 streamed before the stall, and gang 1 while both streamed: the set-up works.
        assert phases["alone"]["gang2_mbit_s"] > 0
        assert phases["shared"]["gang1_mbit_s"] > 0
        for phase in phases.values():
            assert phase["window_s"] > 0
            assert "gang2_longest_gap_ms" in phase and "others_busy_cores" in phase
        assert set(config["ratios"]) >= {"stalled_over_unstalled", "recovered_over_unstalled"}
        assert set(config["connected_at_end"]) == {"a1", "b1", "a2", "b2"}
    assert set(result["summary"]) == {"capped", "uncapped"}

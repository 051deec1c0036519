"""The node repair bench still runs: a --quick run decides every signal and reports every
figure. Behaviour only; the bench reports speed, this test never judges it."""

from __future__ import annotations

import pytest

from tests.bench.as_user import run_bench


@pytest.mark.slow
def test_quick_bench_decides_every_signal_and_reports_its_figures() -> None:
    result = run_bench("remediation", ["--quick", "--timeout", "240"], timeout=280)
    for key in ("baseline", "decision_latency", "burst", "ratios", "remediator_start_s"):
        assert key in result, key
    assert result["burst"]["complete"] is True
    assert result["decision_latency"]["n"] == 50
    assert result["burst"]["alerts"]["count"] == 950
    assert result["burst"]["recommendations"]["count"] == 950
    assert result["decision_latency"]["remediator_internal"]["decisions"] == 50

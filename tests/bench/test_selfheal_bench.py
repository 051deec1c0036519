"""The self-healing bench still runs: a 2-member gang heals, and every figure is there.
Figures are reported, never judged."""

from __future__ import annotations

import pytest

from tests.bench.as_user import run_bench


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quick_bench_heals_a_gang_and_reports_every_figure() -> None:
    result = run_bench("selfheal", ["--quick"], timeout=580)
    assert "error" not in result, result.get("error")
    [gang] = result["gangs"]
    seen = gang["from_fault_line_s"]
    for what in ("alert", "old_epoch_fenced", "new_epoch_placed", "running_again"):
        assert what in seen, seen
    assert "back_in_pool" in seen and gang["floor_first_placement_to_running_s"] > 0

"""The agent-restart bench still runs: a short run SIGKILLs a Relayed member's agent under a
running stream, in both modes, and reports the stream's longest gap. Behaviour only: what each
mode reports is there; the gaps themselves are never judged."""

from __future__ import annotations

import pytest

from tests.bench import agent_restart
from tests.bench.as_user import run_bench


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_short_bench_reports_both_modes() -> None:
    result = run_bench("agent_restart", ["--quick"], timeout=280)
    for mode in agent_restart.MODES:
        figures = result["modes"][mode]
        assert "error" not in figures, figures
        assert figures["echoed_before_kill"] > 0
        assert figures["longest_gap_s"] > 0
        assert figures["epoch_before"] == figures["epoch_after"] == 1
    assert set(result["summary"]["longest_gap_s"]) == set(agent_restart.MODES)

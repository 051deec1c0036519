"""The watch-failover bench still runs: in each arm the watch sees the write after the kill.
Figures are reported, never judged."""

from __future__ import annotations

import pytest

from tests.bench.as_user import run_bench


@pytest.mark.slow
def test_quick_bench_sees_the_write_after_each_kill() -> None:
    result = run_bench("watch_failover", ["--quick"], timeout=280)
    assert "error" not in result, result.get("error")
    for arm in ("build", "baseline"):
        assert result["summary"][arm]["never_saw"] == 0, result

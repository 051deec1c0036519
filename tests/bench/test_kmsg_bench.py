"""The kernel log bench still runs: a --quick run measures the read rates and the alert latency
and reads the whole burst. Behaviour only; the bench reports speed, this test never judges it."""

from __future__ import annotations

import pytest

from tests.bench.as_user import run_bench
from tests.kmsg_support import kmsg_writable


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(kmsg_writable() is not None, reason=str(kmsg_writable()))
def test_quick_bench_measures_the_reader_and_the_daemon() -> None:
    result = run_bench("kmsg", ["--quick"], timeout=280)
    assert "error" not in result, result.get("error")
    rates = result["read_rate"]
    for path in ("raw", "reader", "file"):
        assert rates[path]["records"] > 0 and rates[path]["records_per_s"] > 0
    assert set(rates["ratios"]) == {"reader_over_raw", "file_over_raw"}
    assert set(rates["old_file_reader_on_dev_kmsg"]) == {"blocked", "seconds", "xid_seen", "error"}
    assert result["alert_latency"]["n"] == 10
    assert result["bus_hop"]["n"] == 20
    burst = result["burst"]
    assert burst["records"] == 10_000 and burst["accounted"] is True
    assert result["kmsg_overruns"] == 0

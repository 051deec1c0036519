"""The shim bench still runs: a --quick run measures every path and reports every figure, and
the endpoint carried exactly the connections it should have. Behaviour only; the bench
reports speed, this test never judges it."""

from __future__ import annotations

import pytest

from tests.bench.as_user import run_bench


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quick_bench_measures_every_path() -> None:
    result = run_bench("shim", ["--quick"], timeout=280)
    assert "error" not in result, result.get("error")
    paths = set(result["connect"])
    assert {"direct", "shim_bypass", "shim"} <= paths
    for path in paths:
        figures = result["connect"][path]
        assert figures["n"] == 200
        assert 0 < figures["p50_us"] <= figures["p99_us"]
        assert result["stream"][path]["best_gbytes_s"] > 0
    # Proof of the paths: through the endpoint exactly when they should be.
    carried = {path: result["connect"][path]["carried_by_endpoint"] for path in paths}
    assert carried["direct"] == 0 and carried["shim_bypass"] == 0
    assert carried["shim"] == 200
    if "proxychains4" in paths:
        assert carried["proxychains4"] == 200
    assert set(result["ratios"]) >= {
        "connect_p50_shim_over_direct",
        "stream_bypass_over_direct",
        "splice_cost_direct_over_via_endpoint",
    }

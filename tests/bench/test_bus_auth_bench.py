"""The bus-auth bench still runs: both servers answer every kind of operation. Figures are
reported, never judged."""

from __future__ import annotations

from tests.bench.as_user import run_bench


def test_quick_bench_measures_both_buses() -> None:
    result = run_bench("bus_auth", ["--quick"], timeout=280)
    assert "error" not in result, result.get("error")
    for kind in ("no_auth", "nkey_confined"):
        assert all(value > 0 for value in result["median"][kind].values()), result

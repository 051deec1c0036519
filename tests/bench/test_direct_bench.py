"""The Direct bench still runs: a --quick run measures every figure it reports (goodput over
nodus0 and its ceiling, the bare wireguard-go figures (one veth, the lab's path), which
WireGuard ran, ICE for 2 and 4 members, the fallback
and its gaps), and every pair of its gangs went direct. Behaviour only; the bench reports
speed, this test never judges it."""

from __future__ import annotations

import pytest

from app.demo import lab_unavailable
from tests.bench.as_user import run_bench


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.skipif(lab_unavailable() is not None, reason=str(lab_unavailable()))
def test_quick_bench_measures_every_figure() -> None:
    result = run_bench("direct", ["--quick"], timeout=380)
    assert "error" not in result, result.get("error")
    goodput = result["goodput"]
    assert goodput["best_gbit_s"]["eth0"] > 0 and goodput["best_gbit_s"]["nodus0"] > 0
    assert goodput["median_gbit_s"]["bare_veth"] > 0 and goodput["median_gbit_s"]["bare_lab"] > 0
    assert goodput["nodus0_over_bare_veth"] is not None
    assert result["wireguard"]["implementation"] in ("kernel", "wireguard-go")
    assert result["wireguard"]["version"]
    assert goodput["wireguard_processes"] == 2
    for members, figures in result["ice"].items():
        assert figures["direct_pairs"] == figures["pairs"], (members, figures)
    fallback = result["fallback"]
    assert fallback["seconds_to_relays"] is not None
    assert fallback["seconds_to_direct_again"] is not None
    assert set(fallback["longest_gap_ms"]) == {"before_cut", "around_cut", "around_restore"}

"""The Relayed-path bench still runs: a --quick run completes, reports every figure, and every
byte it streamed arrived intact. Behaviour only; the bench reports speed, this test never
judges it."""

from __future__ import annotations

import shutil

import pytest

from tests.bench.as_user import run_bench


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(shutil.which("socat") is None, reason="socat missing (make system-deps)")
def test_quick_bench_completes_with_every_figure_and_intact_bytes() -> None:
    result = run_bench("relay", ["--quick"], timeout=580)
    assert "error" not in result, result.get("error")
    assert result["intact"] is True

    off = result["cap_off"]
    for path in ("direct", "socat", "socat_chain", "sealed_chain", "relayed"):
        assert off[path]["intact"] is True
        assert off[path]["mbit_s_median"] > 0
    assert off["relayed"]["cpu_s_per_gbit_median"] is not None
    assert set(off["ratios"]) >= {
        "relayed_over_direct",
        "relayed_over_socat",
        "cpu_per_gbit_relayed_over_socat",
        "relayed_over_sealed_chain",
        "cpu_per_gbit_relayed_over_sealed_chain",
    }

    one = result["cap_on"]["one_gang"]
    for key in ("a_to_b_alone", "b_to_a_alone", "both_at_once"):
        assert all(flow["intact"] for flow in one[key]["flows"].values())
        assert all(flow["received_bytes"] > 0 for flow in one[key]["flows"].values())

    gangs = result["cap_on"]["gangs"]
    assert gangs["intact"] is True
    assert len(gangs["per_gang_mbit_s"]) == gangs["gangs"] == 8
    assert gangs["jain_fairness"] is not None and gangs["min_over_max"] is not None

    failover = result["cap_on"]["failover"]
    assert failover["intact"] is True
    assert failover["killed"] in {"relay-0", "relay-1"}
    assert set(failover["time_to_move_s"]) == set(failover["homes_before"])
    for flow in failover["delivery"].values():
        assert flow["bytes_after_kill"] > 0
        assert "longest_gap_ms" in flow


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_quick_bench_with_a_third_relay_measures_the_rescue() -> None:
    # Both of gang 0's relays killed and left down: its members move to the third relay.
    args = ["--quick", "--only", "cap-on", "--gangs", "2", "--relays", "3"]
    result = run_bench("relay", args, timeout=580)
    assert "error" not in result, result.get("error")
    rescue = result["cap_on"]["rescue"]
    assert rescue["intact"] is True
    assert len(rescue["killed"]) == 2
    third = {f"relay-{i}" for i in range(3)} - set(rescue["killed"])
    assert set(rescue["homes_after"].values()) == third
    assert all(t is not None for t in rescue["time_to_rescue_s"].values())
    for flow in rescue["delivery"].values():
        assert flow["bytes_after_kill"] > 0 and flow["longest_gap_ms"] is not None

"""The placement bench still runs: a --quick run reaches a decision for every job and reports
every figure. Behaviour only; the bench reports speed, this test never judges it."""

from __future__ import annotations

import pytest

from tests.bench import placement
from tests.bench.as_user import run_bench


@pytest.mark.slow
def test_quick_bench_decides_every_job_and_reports_its_figures() -> None:
    result = run_bench("placement", ["--quick", "--timeout", "240"], timeout=280)

    assert "error" not in result, result.get("error")
    assert result["timed_out"] is False
    assert placement.completed(result)
    for key in (
        "params",
        "fleet",
        "jobs",
        "placer_start",
        "baseline",
        "placement",
        "placer_internal",
        "cpu_s_during_burst",
        "ratios",
    ):
        assert key in result, key

    assert result["fleet"]["machines"] == 1000
    assert result["fleet"]["unique_addresses"] is True
    assert result["placer_log"]["ready_line"].endswith("ready with 1000 machines")

    placement_figures = result["placement"]
    assert placement_figures["submitted"] == 100
    assert placement_figures["undecided"] == 0
    assert (
        placement_figures["placed"]
        + placement_figures["unschedulable"]
        + placement_figures["refused"]
        == 100
    )
    assert placement_figures["placed"] > 0
    assert placement_figures["apply_to_placed_ms"]["n"] == placement_figures["placed"]
    for figure in ("p50", "p99"):
        assert figure in placement_figures["apply_to_placed_ms"]
        assert figure in placement_figures["apply_reply_ms"]
        assert figure in result["baseline"]["nats_rtt_ms"]
        assert figure in result["baseline"]["kv_put_ms"]
    assert placement_figures["decisions_per_second"] is not None
    assert result["ratios"]["apply_to_placed_p50_over_nats_rtt_p50"] is not None

    # With the bench's relays announced (one or two in each region class), every Relayed
    # gang gets two by name, and every member homes on a relay of its region class.
    homed = sum(placement_figures["relayed_members_per_relay"].values())
    relayed = placement_figures["paths"].get("relayed", 0)
    assert placement_figures["gangs_with_named_relays"] >= relayed
    assert relayed == 0 or homed >= 2 * relayed
    assert placement_figures["relayed_members_homed_near"] == homed, placement_figures

    # The placer counted the same decisions the watch saw, and was stopped cleanly.
    decisions = result["placer_internal"]["decisions"]
    assert decisions["placed"] == placement_figures["placed"]
    assert decisions["unschedulable"] == placement_figures["unschedulable"]
    assert result["placer_exit_code"] == 0


@pytest.mark.slow
def test_two_replicas_share_the_burst_and_place_each_job_once() -> None:
    result = run_bench("placement", ["--quick", "--replicas", "2", "--timeout", "240"], timeout=280)

    assert placement.completed(result), result.get("error")
    assert result["params"]["placer_replicas"] == 2
    assert result["replicas"] == {"count": 2, "placed_checked": 100, "ok": True, "problems": []}
    assert result["placer_internal"]["decisions"]["placed"] == result["placement"]["placed"]
    assert result["placer_exit_codes"] == [0, 0]

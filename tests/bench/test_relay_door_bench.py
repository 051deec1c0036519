"""The shared-port bench still runs: every connection reaches the relay its member named,
through the relay's own port and through the port it shares, and connections were handed on
between the relay processes. Latencies are reported, never judged."""

from __future__ import annotations

from tests.bench.as_user import run_bench


def test_quick_bench_measures_own_and_shared_ports() -> None:
    result = run_bench("relay_door", ["--quick"], timeout=280)
    assert "error" not in result, result.get("error")
    figures = result["connect_to_welcome"]
    assert figures["own_port"]["n"] == 80
    # The kernel chose either relay for each of 80 connections: both kinds occurred.
    assert figures["shared_direct"]["n"] + figures["shared_handed"]["n"] == 80
    assert figures["shared_handed"]["n"] > 0 and figures["shared_direct"]["n"] > 0

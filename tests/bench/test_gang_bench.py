"""The gang bench still runs: a --quick run completes and reports every figure from measured
values. Behaviour only; the bench reports speed, this test never judges it."""

from __future__ import annotations

import pytest

from tests.bench.as_user import run_bench


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_quick_bench_completes_with_every_figure() -> None:
    result = run_bench("gang", ["--quick"], timeout=380)
    assert "error" not in result, result.get("error")

    probes = {p["members"]: p for p in result["probe"]}
    assert set(probes) == {2, 4}
    for members, probe in probes.items():
        assert probe["rounds"] == members // 2
        assert probe["pairs"] == members * (members - 1) // 2
        assert len(probe["perRound"]) == probe["rounds"]
        assert probe["minimumSeconds"] >= probe["rounds"] * probe["sampleSeconds"]
        assert probe["probeWallSeconds"] > 0 and probe["roundsWallSeconds"] > 0
        assert probe["slowestPair"]["path"] == "direct"

    startup = result["relayedStartup"]
    for key in (
        "placementSeconds",
        "joinSeconds",
        "probeSeconds",
        "launchSeconds",
        "applyToRunningSeconds",
    ):
        assert startup[key] is not None and startup[key] >= 0, (key, startup)
    assert startup["probe"]["path"].startswith("derp:")

    allreduce = result["allreduce"]
    for path in ("relayed", "loopback"):
        assert len(allreduce[path]["ranks"]) == 2
        assert all(rank["verified"] is True for rank in allreduce[path]["ranks"])
        assert allreduce[path]["busGbps"] > 0
    assert allreduce["relayedOverLoopback"] is not None
    assert result["relayedBilling"]["usageRelayBytesAfterwards"] > 0

"""Issue 26's done-when on real processes, by the bench as a user runs it: `nodus qualify --path
relayed --members 8` records a qualification, which admits the 8-member job; 8 Relayed members
each sending to the next at once get 0.11-0.13 Gbit/s each (their share of the gang's 1 Gbit/s,
G18), Jain's index over the 8 at least 0.95, the gang's total at most 1 Gbit/s, each member
billed what its program sent within 0.1 %; then, with the relay most of them send through
SIGKILLed under their streams, every stream arrives whole. The gaps are reported, not judged,
and the share's floor only when the machine had 1.5 cores idle before the ring (a noisy
machine measures itself)."""

from __future__ import annotations

import warnings

import pytest

from tests.bench.as_user import run_bench

FLAGS = ["--members", "8", "--qualify", "--seconds", "6", "--failover", "8"]
FLAGS += ["--failover-seconds", "5", "--sample-seconds", "1"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_eight_members_share_the_gangs_rate_are_billed_once_and_outlive_a_relay_kill() -> None:
    result = run_bench(
        "relayed_gang",
        FLAGS,
        timeout=280,
    )
    assert "error" not in result, result.get("error")
    [gang] = result["gangs"]
    qualification = gang["qualification"]
    assert qualification["ok"] and qualification["members"] == 8, qualification
    assert qualification["machines"] == 8 and qualification["tcpGbps"] > 0, qualification
    assert gang["membersPerRelay"] == [4, 4], gang  # spread evenly over the two relays
    assert gang["probe"]["rounds"] == 4 and gang["probe"]["pairs"] == 28, gang["probe"]
    ring = gang["ring"]
    assert all(g <= 0.13 for g in ring["perMemberGbps"]), ring  # each held to its share
    if ring["idleCoresBefore"] >= 1.5:
        assert all(g >= 0.11 for g in ring["perMemberGbps"]), ring
    else:
        warnings.warn(f"the ring's floor of 0.11 Gbit/s not checked: {ring}", stacklevel=1)
    assert ring["jain"] >= 0.95 and ring["gangTotalGbps"] <= 1.0, ring
    assert all(b <= 1.001 for b in ring["billedOverSent"]), ring
    assert all(b >= 1.0 for b in ring["billedOverReceived"]), ring
    failover = gang["failover"]
    assert failover["membersOnKilled"] >= 4 and failover["allMovedWithinSeconds"] is not None
    assert failover["streamsBroken"] == 0, failover

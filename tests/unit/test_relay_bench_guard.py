"""The relay bench's guard: the Relayed path below half of the sealed socat chain of the same
run is a regression, and a run that measured no such ratio fails too."""

from __future__ import annotations

from tests.bench.relay import guard


def ratios(**values: float) -> dict[str, object]:
    return {"cap_off": {"ratios": values}}


def test_the_guard_holds_at_half_the_sealed_chain_and_fails_below() -> None:
    assert guard(ratios(relayed_over_sealed_chain=0.78, relayed_over_socat_chain=0.45)) is None
    below = guard(ratios(relayed_over_sealed_chain=0.42))
    assert below is not None and "0.42 is below 0.5" in below
    assert guard({}) == "no relayed-over-sealed-chain ratio was measured"

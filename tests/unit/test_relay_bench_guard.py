"""The relay bench's verdict: the Relayed path below half of the sealed socat chain of the same
run is a regression, and a run that measured no such ratio fails too; a run is intact when
every part asked for ran and delivered every byte."""

from __future__ import annotations

from tests.bench.relay import completed, guard


def ratios(**values: float) -> dict[str, object]:
    return {"cap_off": {"ratios": values}}


def test_the_guard_holds_at_half_the_sealed_chain_and_fails_below() -> None:
    assert guard(ratios(relayed_over_sealed_chain=0.78, relayed_over_socat_chain=0.45)) is None
    below = guard(ratios(relayed_over_sealed_chain=0.42))
    assert below is not None and "0.42 is below 0.5" in below
    assert guard({}) == "no relayed-over-sealed-chain ratio was measured"


def cap_off(intact: bool = True) -> dict[str, object]:
    part = {"intact": True}
    flows = {"a_to_b": {"intact": intact}, "b_to_a": {"intact": True}}
    return {
        **{p: part for p in ("direct", "socat", "socat_chain", "sealed_chain", "relayed")},
        "relayed_both_ways": {"flows": flows},
    }


def test_a_run_of_one_half_is_judged_on_that_half_and_a_lost_byte_still_fails_it() -> None:
    """`--only cap-off` reported "bytes were lost or corrupted" for the half it never ran."""
    assert completed({"cap_off": cap_off()}, only="cap-off")
    assert not completed({"cap_off": cap_off(intact=False)}, only="cap-off")
    assert not completed({"cap_off": cap_off()})  # the whole run needs cap on too
    assert not completed({"cap_off": {}}, only="cap-off")  # a part that did not run

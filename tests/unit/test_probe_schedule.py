"""The probe's rounds (G10): every pair once, no member sending two samples or receiving two
in one round, N/2 rounds."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from services.runner.schedule import rounds


@pytest.mark.parametrize("n", range(2, 9))
def test_every_pair_once_and_no_member_twice_in_one_direction(n: int) -> None:
    members = [f"m{i}" for i in range(n)]
    schedule = rounds(members)
    assert len(schedule) == n // 2
    measured = [frozenset(pair) for round_ in schedule for pair in round_]
    assert sorted(measured, key=sorted) == sorted(
        (frozenset(p) for p in itertools.combinations(members, 2)), key=sorted
    )
    for round_ in schedule:
        assert all(a != b for a, b in round_)
        assert max(Counter(a for a, _ in round_).values()) == 1  # sends one sample
        assert max(Counter(b for _, b in round_).values()) == 1  # receives one


def test_two_members_one_pair() -> None:
    assert rounds(["a", "b"]) == [[("a", "b")]]

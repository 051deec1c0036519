"""A placement that lost a race waits a random, growing time before it plans again, so two
replicas that lost to each other do not retry in step (chaos seed 528796: two replicas split a
gang's machines between them for minutes, each woken by the other's release)."""

from __future__ import annotations

import random

from services.placer.service import _race_backoff


def test_two_replicas_that_lost_to_each_other_wait_different_times() -> None:
    random.seed(528796)
    for attempt in range(1, 6):
        waits = {_race_backoff(attempt) for _ in range(50)}
        assert len(waits) == 50  # never in step


def test_the_wait_grows_with_each_loss_and_stays_under_a_second() -> None:
    random.seed(1)
    longest = [max(_race_backoff(attempt) for _ in range(2000)) for attempt in range(1, 9)]
    assert all(0.0 <= wait <= 1.0 for wait in longest)
    assert longest[0] < 0.05 and longest[3] > 0.2 and longest[-1] > 0.9
    assert longest[:5] == sorted(longest[:5])  # doubling, until the one-second cap

"""A Direct pair's path decision (services/agent/pairpath.py), with the clock in the test's
hands: falling back when the peer falls silent or disagrees, retrying, joining the peer's
round, and coming back."""

from __future__ import annotations

from services.agent.direct.pairpath import AGREE_WITHIN, LOSS_AFTER, RETRY_AFTER, PairPath, State


def joined(now: float = 0.0) -> PairPath:
    path = PairPath(now)
    assert path.next_round(now) is None  # the first round runs
    path.round_ended(0, True, now)
    path.heartbeat(now, 0, True)
    return path


def test_the_first_round_goes_direct_or_leaves_the_relays_carrying_the_pair() -> None:
    assert joined().state is State.DIRECT
    failed = PairPath(0.0)
    failed.round_ended(0, False, 1.0)
    assert failed.state is State.RELAYED and not failed.direct
    assert failed.next_round(1.0 + RETRY_AFTER - 0.1) is None
    assert failed.next_round(1.0 + RETRY_AFTER) == 1


def test_heartbeats_keep_it_direct_and_silence_falls_back_at_once_with_a_new_round() -> None:
    path = joined()
    t = 0.0
    for _ in range(20):
        t += 0.25
        path.heartbeat(t, 0, True)
        assert path.next_round(t) is None and path.direct
    assert path.next_round(t + LOSS_AFTER - 0.01) is None
    assert path.next_round(t + LOSS_AFTER + 0.01) == 1
    assert path.state is State.RELAYED and path.running and path.round == 1
    path.round_ended(1, True, t + 3)
    assert path.direct


def test_a_peer_that_says_it_is_not_direct_on_the_same_round_brings_both_back() -> None:
    path = joined()
    path.heartbeat(1.0, 0, False)  # its checks failed where ours succeeded
    assert path.next_round(1.0) is None  # it may still be finishing
    path.heartbeat(AGREE_WITHIN + 0.5, 0, False)
    assert path.next_round(AGREE_WITHIN + 0.5) == 1


def test_the_peer_s_higher_round_is_joined_even_while_direct() -> None:
    path = joined()
    assert path.next_round(1.0, offered=3) == 3
    assert path.state is State.RELAYED and path.running
    assert path.next_round(1.1, offered=3) is None  # on it already
    path.round_ended(2, True, 2.0)  # an older round's end changes nothing
    assert path.running
    path.round_ended(3, True, 2.0)
    assert path.direct and path.round == 3

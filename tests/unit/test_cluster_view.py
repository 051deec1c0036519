"""The placer judges heartbeats against what its view has heard: a machine that stops while
others go on is lost after the timeout, but a view whose watch stalled (no heartbeat from anyone)
does not take every machine for dead, until three timeouts of silence."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from libs.contracts.fleet import NodeHealth
from services.placer.cluster import ClusterView

T0 = datetime(2026, 12, 4, tzinfo=UTC)
TIMEOUT = 5.0


def beat(view: ClusterView, node: str, at: float) -> None:
    t = T0 + timedelta(seconds=at)
    view.set_health(node, NodeHealth(node=node, healthy=True, heartbeat_time=t), t)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_a_machine_that_stops_while_others_go_on_is_lost_after_the_timeout() -> None:
    view = ClusterView(TIMEOUT)
    for second in range(12):
        beat(view, "a", second)
        if second <= 2:
            beat(view, "b", second)
    assert view.alive("a", at(11.5))
    assert not view.alive("b", at(11.5))  # silent 9.5 s while a went on


def test_a_view_that_hears_nobody_does_not_take_every_machine_for_dead() -> None:
    view = ClusterView(TIMEOUT)
    for second in range(3):
        beat(view, "a", second)
        beat(view, "b", second)
    # The watch stalls at 2 s: ten seconds later, both still count as alive.
    assert view.alive("a", at(12)) and view.alive("b", at(12))
    # Three timeouts of silence: everyone may really be gone.
    assert not view.alive("a", at(2 + 3 * TIMEOUT + 1))


def test_when_heartbeats_come_back_after_a_silence_the_others_have_time_to_beat() -> None:
    """The bus was away 6 s: a's first beat after it must not make b, whose write is still
    being retried, look dead; a machine that stays silent is still lost a timeout later."""
    view = ClusterView(TIMEOUT)
    for second in range(5):
        beat(view, "a", second)
        beat(view, "b", second)
        beat(view, "c", second)
    beat(view, "a", 10.0)  # the first write through after the outage (4 s to 10 s)
    assert view.alive("b", at(10.5)) and view.alive("c", at(10.5))
    beat(view, "b", 11.0)
    beat(view, "a", 11.0)
    for second in range(12, 20):
        beat(view, "a", second)
        beat(view, "b", second)
    assert view.alive("b", at(19.5))
    assert not view.alive("c", at(19.5))  # never came back

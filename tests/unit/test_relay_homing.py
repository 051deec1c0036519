"""A Relayed member homes on the relay the placer chose for its gang (the first it is given),
even when the other answers first; if that one does not come up in its grace, the other; and
after a failover, home again on the chosen one once it is back and stays up."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from libs.relayproto.client import RelayClient
from services.agent.relayed import homing
from services.agent.relayed.homing import RelayHome


class FakeRelay:
    def __init__(self, name: str) -> None:
        self.name = name
        self.up = False
        self.homed: list[bool] = []

    def home(self, failover: bool) -> None:
        self.homed.append(failover)

    def close(self) -> None:
        self.up = False


def relay_home(*relays: FakeRelay) -> RelayHome:
    return RelayHome("n1", cast(list[RelayClient], list(relays)), lambda: None)


def come_up(home: RelayHome, relay: FakeRelay) -> None:
    relay.up = True
    home._up(cast(Any, relay))


async def test_the_chosen_relay_is_home_though_the_other_answered_first() -> None:
    chosen, other = FakeRelay("relay-b"), FakeRelay("relay-a")
    home = relay_home(chosen, other)
    come_up(home, other)
    assert home.home is None, "the other relay waits out the chosen one's grace"
    come_up(home, chosen)
    assert home.home is cast(Any, chosen) and chosen.homed == [False]
    await asyncio.sleep(0)
    home.close()


async def test_a_chosen_relay_that_stays_down_leaves_the_other_home_after_its_grace(
    monkeypatch: Any,
) -> None:
    monkeypatch.setattr(homing, "HOME_GRACE_SECONDS", 0.05)
    chosen, other = FakeRelay("relay-b"), FakeRelay("relay-a")
    home = relay_home(chosen, other)
    come_up(home, other)
    await asyncio.sleep(0.1)
    assert home.home is cast(Any, other) and other.homed == [False]
    home.close()


async def test_after_losing_every_relay_the_first_back_is_home_again(monkeypatch: Any) -> None:
    monkeypatch.setattr(homing, "HOME_GRACE_SECONDS", 0.05)
    chosen, other = FakeRelay("relay-b"), FakeRelay("relay-a")
    home = relay_home(chosen, other)
    come_up(home, other)
    await asyncio.sleep(0.1)
    assert home.home is cast(Any, other)
    other.up = False
    home._down(cast(Any, other))  # lost, and the chosen one is down too
    assert home.home is None
    come_up(home, other)  # back: home again once the chosen one's grace has passed
    await asyncio.sleep(0.1)
    assert home.home is cast(Any, other)
    home.close()


def lose(home: RelayHome, relay: FakeRelay) -> None:
    relay.up = False
    home._down(cast(Any, relay))


def failed_over_and_back(monkeypatch: Any) -> tuple[RelayHome, FakeRelay, FakeRelay]:
    """A member homed on its chosen relay, failed over to the other, the chosen one back."""
    monkeypatch.setattr(homing, "RETURN_HOME_SECONDS", 0.05)
    chosen, other = FakeRelay("relay-b"), FakeRelay("relay-a")
    home = relay_home(chosen, other)
    come_up(home, chosen)
    come_up(home, other)
    lose(home, chosen)
    assert home.home is cast(Any, other) and other.homed == [True]  # the failover
    come_up(home, chosen)
    return home, chosen, other


async def test_after_a_failover_the_member_moves_home_once_its_relay_stays_up(
    monkeypatch: Any,
) -> None:
    # The placer spread gangs by their chosen relays; a restart of one (an upgrade) must not
    # leave every member it had on the other for good.
    home, chosen, other = failed_over_and_back(monkeypatch)
    assert home.home is cast(Any, other), "not before it has stayed up"
    await asyncio.sleep(0.1)
    assert home.home is cast(Any, chosen) and chosen.homed == [False, False]
    home.close()


async def test_a_chosen_relay_that_goes_down_again_at_once_is_not_moved_to(
    monkeypatch: Any,
) -> None:
    home, chosen, other = failed_over_and_back(monkeypatch)
    lose(home, chosen)  # restarting again
    await asyncio.sleep(0.1)
    assert home.home is cast(Any, other) and chosen.homed == [False]
    home.close()


async def test_a_member_whose_relays_are_all_gone_homes_on_the_relay_it_is_given(
    monkeypatch: Any,
) -> None:
    # Both of the gang's relays lost for good (their host): the member is stranded until it
    # is given another, which is home as soon as it is up; once the chosen relay is back and
    # stays up, the member moves home to it as after any failover.
    monkeypatch.setattr(homing, "RETURN_HOME_SECONDS", 0.05)
    chosen, other, spare = FakeRelay("relay-b"), FakeRelay("relay-a"), FakeRelay("relay-c")
    home = relay_home(chosen, other)
    come_up(home, chosen)
    come_up(home, other)
    assert home.stranded_for() == 0.0
    lose(home, chosen)
    assert home.stranded_for() == 0.0, "the other relay is up"
    lose(home, other)
    assert home.home is None
    await asyncio.sleep(0.02)
    assert home.stranded_for() >= 0.02
    home.rescue(cast(Any, spare))
    assert home.rescues == 1 and home.stranded_for() < 0.02, "the clock starts again"
    come_up(home, spare)
    assert home.home is cast(Any, spare) and spare.homed == [False], "at once, no grace"
    assert home.stranded_for() == 0.0
    come_up(home, chosen)
    await asyncio.sleep(0.1)
    assert home.home is cast(Any, chosen)
    home.close()


async def test_the_first_relay_back_after_all_were_lost_is_home_at_once() -> None:
    chosen, other = FakeRelay("relay-b"), FakeRelay("relay-a")
    home = relay_home(chosen, other)
    come_up(home, chosen)
    lose(home, chosen)
    come_up(home, other)  # not the chosen one, but the member has nowhere else to be
    assert home.home is cast(Any, other) and other.homed == [False]
    home.close()

"""The relay bill of a member (G17): its own total, counted once, within what the relays
metered; never more than they metered, and never much less."""

from __future__ import annotations

from datetime import UTC, datetime

from libs.contracts.bounds import LINK_MAX_INFLIGHT_BYTES as WINDOW
from libs.contracts.relay import UsageRecord
from libs.jobs.billing import billed_bytes

MiB = 1 << 20
T = datetime(2026, 12, 4, tzinfo=UTC)


def record(
    relay: str, node: str, metered: int, reported: int = 0, gang: str = "acme.g"
) -> UsageRecord:
    return UsageRecord(
        relay=relay,
        boot="b",
        gang=gang,
        epoch=1,
        node=node,
        seq=1,
        bytes_sent=metered,
        start_time=T,
        end_time=T,
        reported=reported,
    )


def test_bytes_resent_after_a_relay_died_are_billed_once() -> None:
    # a sent 1,000 MiB: relay-0 metered 600 of it and 3 more that a resent through relay-1
    # after relay-0 died, with the 400 left; both heard a's own totals.
    records = [
        record("relay-0", "a", 603 * MiB, 600 * MiB),
        record("relay-1", "a", 403 * MiB, 1000 * MiB),
    ]
    assert billed_bytes(records) == {"acme.g": 1000 * MiB}


def test_a_member_that_tells_less_than_it_sent_saves_at_most_a_window_per_relay() -> None:
    records = [record("relay-0", "a", 600 * MiB, 1), record("relay-1", "a", 400 * MiB, 2)]
    assert billed_bytes(records) == {"acme.g": 1000 * MiB - 2 * WINDOW}


def test_a_member_that_tells_more_than_it_sent_is_billed_what_the_relays_metered() -> None:
    assert billed_bytes([record("relay-0", "a", 5 * MiB, 50 * MiB)]) == {"acme.g": 5 * MiB}


def test_a_member_that_tells_nothing_is_billed_what_the_relays_metered() -> None:
    records = [record("relay-0", "a", 7 * MiB), record("relay-1", "a", 2 * MiB)]
    assert billed_bytes(records) == {"acme.g": 9 * MiB}


def test_members_and_gangs_are_billed_apart() -> None:
    records = [
        record("relay-0", "a", 10 * MiB, 9 * MiB),
        record("relay-0", "b", 4 * MiB),
        record("relay-1", "c", 3 * MiB, 3 * MiB, gang="acme.h"),
    ]
    assert billed_bytes(records) == {"acme.g": 13 * MiB, "acme.h": 3 * MiB}

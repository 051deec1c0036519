"""C3 for Relayed gangs of N members (issue 26): what each member may send, what its links keep
in flight and what a relay queues to it follow from the gang's size, not from a pair's."""

from __future__ import annotations

import pytest

from libs.contracts.bounds import (
    LINK_MAX_INFLIGHT_BYTES,
    RELAY_GANG_BITS_PER_SECOND,
    derive,
    destination_queue_bytes,
    link_inflight,
)
from libs.contracts.jobs import PathClass


@pytest.mark.parametrize("members", range(2, 9))
def test_a_gangs_relay_rate_and_buffers_are_split_across_its_members(members: int) -> None:
    bounds = derive(PathClass.RELAYED, members)
    assert bounds.relay_member_bits_per_second * members <= RELAY_GANG_BITS_PER_SECOND
    inflight = link_inflight(bounds)
    # A member sends at its share of the rate: rate x RTT in flight suffices, to any one peer.
    assert inflight <= LINK_MAX_INFLIGHT_BYTES
    assert inflight >= min(bounds.tunnel_buffer_bytes, LINK_MAX_INFLIGHT_BYTES)
    # A relay holds what every other member may have in flight to one member, with room.
    assert destination_queue_bytes(members) >= (members - 1) * inflight


def test_a_larger_gang_keeps_less_in_flight_per_link_and_queues_more_per_member() -> None:
    pair, eight = derive(PathClass.RELAYED, 2), derive(PathClass.RELAYED, 8)
    assert link_inflight(eight) * 4 == pytest.approx(link_inflight(pair), rel=0.01)
    assert destination_queue_bytes(8) > destination_queue_bytes(2)

"""What a gang is billed for the relays (G17), from the usage records they published: pure.

A relay meters the bytes each member's programs sent through it (the plaintext of their
WireGuard transport messages), and the member tells its relay its own total of the same bytes,
each counted once (`Sent`). They differ by what the member sent again: after a relay died, the
link resends what was not acknowledged, and the dead relay had metered part of it. So a
member is billed its own total, the highest any relay heard, as long as the relays' counts
agree with it within one in-flight window per relay that carried it (a member that told less
than it sent saves at most that); otherwise, or when it told nothing, what the relays metered.
Never more than the relays metered."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from libs.contracts.bounds import LINK_MAX_INFLIGHT_BYTES
from libs.contracts.relay import UsageRecord

Member = tuple[str, int, str]  # gang, epoch, node


@dataclass(slots=True)
class MemberUsage:
    metered: int = 0  # every byte the relays metered, resends included
    reported: int = 0  # the member's own total, the highest heard
    relays: set[str] = field(default_factory=set)

    @property
    def billed(self) -> int:
        if self.reported <= 0:
            return self.metered
        floor = self.metered - LINK_MAX_INFLIGHT_BYTES * len(self.relays)
        return min(self.metered, max(self.reported, floor))


def usage_by_member(records: Iterable[UsageRecord]) -> dict[Member, MemberUsage]:
    members: dict[Member, MemberUsage] = {}
    for record in records:
        usage = members.setdefault((record.gang, record.epoch, record.node), MemberUsage())
        usage.metered += record.bytes_sent
        usage.reported = max(usage.reported, record.reported)
        usage.relays.add(record.relay)
    return members


def billed_bytes(records: Iterable[UsageRecord]) -> dict[str, int]:
    """Relay bytes billed per gang (`org.name`), every epoch and member of it."""
    totals: dict[str, int] = {}
    for (gang, _, _), usage in usage_by_member(records).items():
        totals[gang] = totals.get(gang, 0) + usage.billed
    return totals

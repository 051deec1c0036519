"""What `nodus get relays` shows of each relay: live or silent, the members of active Relayed
gangs homed on it, their shares of their gangs' caps (what the placer balances), and the
gangs that name it."""

from __future__ import annotations

from datetime import timedelta

from libs.contracts.base import now
from libs.contracts.jobs import Phase
from libs.contracts.relay import RelayRecord
from libs.jobs.relays import relay_loads
from tests.factories import relayed


def record(name: str, silent_for: float = 1.0) -> RelayRecord:
    return RelayRecord(
        name=name,
        region="us",
        address="198.18.0.1:443",
        public_key="",
        version="0.1.0",
        capabilities=[],
        heartbeat_time=now() - timedelta(seconds=silent_for),
    )


def test_each_relay_shows_the_members_homed_on_it_and_the_gangs_naming_it() -> None:
    relays = [record("relay-c"), record("relay-a"), record("relay-b", silent_for=60.0)]
    jobs = [
        relayed("a", Phase.RUNNING, [0, 1, 1], 1, relays=["relay-a", "relay-c"]).value,
        # placed without names: its slots are the first two live relays by name
        relayed("b", Phase.PROBING, [0, 0], 2).value,
        relayed("done", Phase.SUCCEEDED, [0, 1], 3, relays=["relay-a", "relay-b"]).value,
    ]
    loads = relay_loads(relays, jobs, now())
    assert [(r.name, r.live, r.members, r.gangs) for r in loads] == [
        ("relay-a", True, 3, ["acme.a", "acme.b"]),
        ("relay-b", False, 0, []),
        ("relay-c", True, 2, ["acme.a", "acme.b"]),
    ]
    # Their shares of their gangs' 1 Gbit/s: a third of a's, and all of b's on relay-a.
    assert [r.cap_mbps for r in loads] == [333 + 1000, 0, 666]

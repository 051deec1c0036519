"""Relays scale out: with four relays (one per core of two relay hosts, say), two Relayed
gangs get two relays each, the least loaded, and carry their probes through them; every relay
holds the sessions of one gang's members, instead of the first two relays holding all of
them and the others idle. Real processes: nats-server, placer, runner, four meshed relays, an
agent per machine with its dataplane."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.e2e import relayed_lab
from tests.e2e.relayed_lab import new_system, start_lab

pytestmark = pytest.mark.slow


def test_two_gangs_on_four_relays_use_two_each(tmp_path: Path) -> None:
    fleet = relayed_lab.fleet("so", 61)
    fleet["machines"] += relayed_lab.fleet("sp", 63)["machines"]
    system = new_system(tmp_path, fleet)
    system.relays = 4
    try:
        first = asyncio.run(start_lab(system, "so", ["sleep", "3600"]))
        second = asyncio.run(start_lab(system, "sp", ["sleep", "3600"], started=True))
        relays_of = {}
        for lab in (first, second):
            gang = lab.get_job().status.gang
            assert gang is not None and len(gang.relays) == 2, gang
            relays_of[lab.job_name] = set(gang.relays)
            homes = {m.node: lab.home_relay(m.node) for m in lab.members}
            # Each member homes on its gang's relays, one member on each (the placer's choice).
            assert set(homes.values()) == set(gang.relays), (lab.job_name, homes, gang.relays)
        assert relays_of["so"].isdisjoint(relays_of["sp"]), relays_of
        # Every relay carries one gang: its two members (each keeps its failover's session).
        sessions = {r: first.metric(r, "nodus_relay_sessions") for r in first.relays()}
        assert sessions == {f"relay-{i}": 2 for i in range(4)}, sessions
    finally:
        system.stop()

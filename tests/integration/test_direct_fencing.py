"""G9 on the Direct path, with real packets between lab namespaces over `nodus0`.

- Fencing: epoch 1 of a gang runs on a and b; a is fenced (its member stops, as the agent
  does when the epoch's join key goes) while b is left on epoch 1, as a partitioned member
  would be; epoch 2 runs on a and c with fresh keys and addresses. a and c reach each other;
  b reaches neither a's old address nor its new one, and a does not reach b's.
- Other gangs: a second gang on d and e at the same time; no member of one reaches a member
  of the other.

Every check is one connection attempt (1.5 s): a pair whose members reported their first
round carries from the first packet, and one that does not is a failure, not a retry.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from app.demo import lab_unavailable
from app.netlab import NetLab
from tests.integration.direct_lab import control_plane, epoch_of, start_members
from tests.integration.lab_programs import lab_fleet, running_lab, seen_by

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(lab_unavailable() is not None, reason=str(lab_unavailable())),
]

ADDRESSES = {
    "vm-a": "198.18.2.1",
    "vm-b": "198.19.3.1",
    "vm-c": "198.18.4.1",
    "vm-d": "198.18.5.1",
    "vm-e": "198.19.6.1",
}
FLEET = lab_fleet(
    *(
        (name, f"p{name[-1]}", address, address.startswith("198.19"))
        for name, address in ADDRESSES.items()
    )
)


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[NetLab]:
    with running_lab(FLEET, tmp_path / "lab.json", reach_from_host=True) as netlab:
        yield netlab


def _reach(lab: NetLab, client: str, server: str, target: str) -> str:
    """What a listener on every address of `server` saw of `client` connecting to `target`."""
    return seen_by(lab.machine_argv(server, []), "0.0.0.0", lab.machine_argv(client, []), target)


def test_a_fenced_epoch_and_other_gangs_are_unreachable_over_nodus0(
    lab: NetLab, tmp_path: Path
) -> None:
    with control_plane(lab, tmp_path) as (server, others):
        first = epoch_of([("vm-a", "100.64.7.1"), ("vm-b", "100.64.7.2")], number=1)
        old = start_members(lab, server, first, ADDRESSES, tmp_path)
        others.extend(old.processes.values())
        other_gang = epoch_of([("vm-d", "100.64.9.1"), ("vm-e", "100.64.9.2")], gang="globex.rl")
        neighbours = start_members(lab, server, other_gang, ADDRESSES, tmp_path)
        others.extend(neighbours.processes.values())
        assert _reach(lab, "vm-b", "vm-a", "100.64.7.1") == "100.64.7.2"

        old.stop("vm-a")  # fenced on a; b is left on epoch 1
        second = epoch_of([("vm-a", "100.64.8.1"), ("vm-c", "100.64.8.2")], number=2)
        new = start_members(lab, server, second, ADDRESSES, tmp_path)
        others.extend(new.processes.values())

        assert _reach(lab, "vm-c", "vm-a", "100.64.8.1") == "100.64.8.2"
        assert _reach(lab, "vm-a", "vm-c", "100.64.8.2") == "100.64.8.1"
        assert _reach(lab, "vm-b", "vm-a", "100.64.8.1") == "unreachable"
        assert _reach(lab, "vm-b", "vm-a", "100.64.7.1") == "unreachable"
        assert _reach(lab, "vm-a", "vm-b", "100.64.7.2") == "unreachable"
        # The other gang's members, from ours and back.
        assert _reach(lab, "vm-d", "vm-e", "100.64.9.2") == "100.64.9.1"
        for ours in ("vm-a", "vm-c"):
            for theirs, address in (("vm-d", "100.64.9.1"), ("vm-e", "100.64.9.2")):
                assert _reach(lab, ours, theirs, address) == "unreachable", (ours, theirs)
        for theirs in ("vm-d", "vm-e"):
            for ours, address in (("vm-a", "100.64.8.1"), ("vm-c", "100.64.8.2")):
                assert _reach(lab, theirs, ours, address) == "unreachable", (theirs, ours)
        new.stop()
        neighbours.stop()
        old.stop("vm-b")

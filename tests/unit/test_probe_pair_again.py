"""A Direct pair whose path dropped while the probe measured it (a first handshake through a
NAT on a loaded host: the demo in the lab failed its probe so, and was placed again) is
measured once more when it is direct again; a pair the relays carried at the sample's start
and end is reported on the relays at once (G12), and a Relayed pair is never measured twice."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from libs.contracts.jobs import PathClass
from libs.contracts.lifecycle import PairResult, ProbePairRequest
from services.agent import gangwork
from services.agent.gangwork import GangWork

REQUEST = ProbePairRequest(gang="acme.a", epoch=1, peer="b", address="100.64.0.2", port=1)


def work_with(
    path: PathClass, measured: list[tuple[str, bool]], now: Iterator[str]
) -> tuple[GangWork, list[str]]:
    """A GangWork whose probe process reports `measured` (the path, whether it was direct at
    the start or end) in turn and whose dataplane answers the pair's path from `now`."""
    work = GangWork.__new__(GangWork)
    work.node = "a"
    work.probing = set()
    runs: list[str] = []

    async def member(gang: str, epoch: int) -> tuple[Any, Any]:
        return SimpleNamespace(path=path), SimpleNamespace()

    async def probe(request: ProbePairRequest) -> tuple[PairResult, bool]:
        path, direct_once = measured[len(runs)]
        runs.append(path)
        return PairResult(a="a", b="b", ok=True, tcp_gbps=1.0, path=path), direct_once

    async def path_of(gang: str, epoch: int, peer: str) -> str:
        return next(now)

    work._member = member  # type: ignore[method-assign]
    work._probe_pair = probe  # type: ignore[method-assign]
    work.path_of = path_of
    return work, runs


async def test_a_direct_pair_that_dropped_while_measured_is_measured_again_once_direct() -> None:
    measured = [("derp:us", True), ("direct", True)]
    work, runs = work_with(PathClass.DIRECT, measured, iter(["derp:us", "direct"]))
    result = await work.probe_pair(REQUEST)
    assert result.path == "direct" and runs == ["derp:us", "direct"]


async def test_a_direct_pair_the_relays_carried_at_both_ends_is_reported_at_once() -> None:
    work, runs = work_with(PathClass.DIRECT, [("derp:us", False)], iter(["direct"]))
    result = await work.probe_pair(REQUEST)
    assert result.path == "derp:us" and runs == ["derp:us"]


async def test_a_pair_that_does_not_come_back_is_reported_on_the_relays(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(gangwork, "DIRECT_AGAIN_WAIT", 0.5)
    work, runs = work_with(PathClass.DIRECT, [("derp:us", True)], iter(lambda: "derp:us", None))
    result = await work.probe_pair(REQUEST)
    assert result.path == "derp:us" and runs == ["derp:us"]


async def test_a_relayed_pair_is_measured_once() -> None:
    work, runs = work_with(PathClass.RELAYED, [("derp:us", True)], iter(["direct"]))
    result = await work.probe_pair(REQUEST)
    assert result.path == "derp:us" and runs == ["derp:us"]

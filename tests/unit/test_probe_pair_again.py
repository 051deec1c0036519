"""A Direct pair whose path dropped while the probe measured it (a first handshake through a
NAT on a loaded host: the demo in the lab failed its probe so, and was placed again) is
measured once more when it is direct again; a pair the relays carried at the sample's start
and end is reported on the relays at once (G12), and a Relayed pair is never measured twice."""

from __future__ import annotations

import asyncio
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


async def test_a_probe_whose_agent_stops_is_killed_and_reaped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The real probe process, waiting for a peer that never answers, goes with its request:
    no probe outlives the agent that started it."""
    started: list[asyncio.subprocess.Process] = []
    spawned = asyncio.Event()
    spawn = asyncio.create_subprocess_exec

    async def recorded(*args: Any, **kwargs: Any) -> asyncio.subprocess.Process:
        process = await spawn(*args, **kwargs)
        started.append(process)
        spawned.set()
        return process

    monkeypatch.setattr(asyncio, "create_subprocess_exec", recorded)
    work, _ = work_with(PathClass.RELAYED, [], iter(lambda: "derp:us", None))
    del work._probe_pair  # the real one: `python -m services.agent.probe`

    async def member(gang: str, epoch: int) -> tuple[Any, Any]:
        return SimpleNamespace(path=PathClass.RELAYED), SimpleNamespace(env={})

    work._member = member  # type: ignore[method-assign]
    closed = ProbePairRequest(
        gang="acme.a", epoch=1, peer="b", address="127.0.0.1", port=9, readiness_seconds=60
    )
    task = asyncio.create_task(work._probe_pair(closed))
    await asyncio.wait_for(spawned.wait(), 10)
    await asyncio.sleep(0.5)  # the probe is up, retrying its peer
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert started[0].returncode is not None  # killed, and waited for (no zombie)

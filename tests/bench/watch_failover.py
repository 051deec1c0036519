"""How long a watch is blind when the server holding its consumer dies: three clustered
nats-servers of the wheel, a bucket of 3 replicas, one watch of one key. Per kill: the server
holding the watch's consumer is SIGKILLed, the key written (retried through an election), and
the time until the watch sees the write is taken; also whether the killed server held the
JetStream metadata (then no consumer can be made until the others elect a new leader) and how
long after that election the watch saw the write.

Two arms, kills interleaved so both see the same machine: tries of RECREATE_TRY_SECONDS to
make the watch's consumer again (the build's) and of `--baseline-try` seconds (2 s before
session 41). Each kill starts a fresh cluster.

    python -m tests.bench.watch_failover [--kills N] [--baseline-try S] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgspec

import libs.bus.kv as kv
from libs.bus import Bus
from libs.bus.server import NatsCluster
from tests.bench.running import (
    add_run_flags,
    bench_main,
    bench_parser,
    machine_facts,
    progress,
    run_bench,
)

log = progress("watch_failover")
BUCKET = "nodus-watch-bench"
SEES_WITHIN = 30.0  # a watch that has not seen the write by then is reported blind


class Count(msgspec.Struct):
    value: int


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = bench_parser("watch_failover", __doc__)
    parser.add_argument("--kills", type=int, default=10, help="kills per arm")
    parser.add_argument("--baseline-try", type=float, default=2.0)
    add_run_flags(parser, budget=900, quick="1 kill per arm")
    args = parser.parse_args(argv)
    if args.quick:
        args.kills = 1
    return args


async def open_bus(cluster: NatsCluster, buckets: tuple[str, ...] = (BUCKET,)) -> Bus:
    deadline = time.monotonic() + 30
    while True:  # the servers elect a JetStream metadata leader first
        try:
            return await Bus.open(
                cluster.url, credentials=cluster.credentials, buckets=list(buckets)
            )
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


@dataclass(frozen=True)
class WatchKill:
    """One watch through the loss of the server holding its consumer, in seconds."""

    heartbeat_s: float  # its consumer's idle heartbeat
    blind_s: float | None  # from the write's return to the watch seeing it; None: never
    election_s: float | None  # from the kill to a new metadata leader; None: none was needed
    after_election_s: float | None  # from that election (or the write, if later) to seeing it


async def watch_through_a_kill(cluster: NatsCluster) -> WatchKill:
    """A watch of one key, the server holding its consumer SIGKILLed, the key written (retried
    through a stream leader's election if need be), the time until the watch sees it."""
    bus = await open_bus(cluster)
    try:
        counter = bus.bucket(BUCKET, Count)
        await counter.put("n", Count(0))
        seen: dict[int, float] = {}
        arrived = {0: asyncio.Event(), 1: asyncio.Event()}

        async def watch() -> None:
            async for change in counter.watch("n"):
                if change.value is not None:
                    seen[change.value.value] = time.monotonic()
                    arrived[change.value.value].set()

        watcher = asyncio.create_task(watch())
        await asyncio.wait_for(arrived[0].wait(), 10)
        consumers = await bus.js._jsm.consumers_info(f"KV_{BUCKET}")
        assert len(consumers) == 1 and consumers[0].cluster is not None, consumers
        holder = consumers[0].cluster.leader
        assert holder is not None and holder.startswith("n"), holder
        killed_at, killed_wall = time.monotonic(), time.time()
        cluster.kill(int(holder[1:]))
        await counter.put("n", Count(1))
        written = time.monotonic()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(arrived[1].wait(), SEES_WITHIN)
        watcher.cancel()
    finally:
        await bus.close()
    elected_wall = cluster.metadata_leader_elected_after(killed_wall)
    elected = None if elected_wall is None else killed_at + elected_wall - killed_wall
    saw = seen.get(1)
    return WatchKill(
        heartbeat_s=consumers[0].config.idle_heartbeat or 0.0,
        blind_s=None if saw is None else round(saw - written, 2),
        election_s=None if elected is None else round(elected - killed_at, 2),
        after_election_s=(
            None if saw is None or elected is None else round(saw - max(written, elected), 2)
        ),
    )


async def _kill(state: Path, try_seconds: float) -> dict[str, Any]:
    """One fresh cluster, one watch, the server holding its consumer killed."""
    kv.RECREATE_TRY_SECONDS = try_seconds
    cluster = NatsCluster(state).start()
    try:
        kill = await watch_through_a_kill(cluster)
    finally:
        cluster.stop()
    return asdict(kill)


def _summary(kills: list[dict[str, Any]]) -> dict[str, Any]:
    blind = [k["blind_s"] for k in kills if k["blind_s"] is not None]
    after = [k["after_election_s"] for k in kills if k["after_election_s"] is not None]
    return {
        "kills": len(kills),
        "never_saw": len(kills) - len(blind),
        "blind_s": {"median": _median(blind), "max": max(blind, default=None)},
        "with_election": len(after),
        "after_election_s": {"median": _median(after), "max": max(after, default=None)},
    }


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 2) if values else None


async def _body(state: Path, args: argparse.Namespace) -> dict[str, Any]:
    os.environ["NODUS_BUS_REPLICAS"] = "3"  # the bucket on every server, as on a real bus
    arms = {"build": kv.RECREATE_TRY_SECONDS, "baseline": args.baseline_try}
    kills: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
    try:
        for index in range(args.kills):
            for arm, try_seconds in arms.items():
                kills[arm].append(await _kill(state / f"{arm}-{index}", try_seconds))
            log(f"kill {index + 1}/{args.kills}")
    finally:
        kv.RECREATE_TRY_SECONDS = arms["build"]
    return {
        "params": {"kills": args.kills, "try_seconds": arms},
        "machine": machine_facts(),
        "summary": {arm: _summary(found) for arm, found in kills.items()},
        "kills": kills,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    return run_bench("nodus-bench-watch-", lambda state: _body(state, args), args, lambda: None)


def main(argv: list[str] | None = None) -> int:
    return bench_main(run, parse_args(argv), lambda: None)


if __name__ == "__main__":
    sys.exit(main())

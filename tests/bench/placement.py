"""Placement benchmark: a generated fleet, a burst of jobs, time from apply to `Placed`.

    .venv/bin/python -m tests.bench.placement            # 10,000 machines, 1,000 jobs
    .venv/bin/python -m tests.bench.placement --quick    # 1,000 machines, 100 jobs (smoke)
    .venv/bin/python -m tests.bench.placement --replicas 2   # two placers share the burst

What runs: a real nats-server with JetStream; the placer as its own process
(`python -m app placer`, the daemon users run); this process as the load generator.
The generated fleet is registered the way agents do it (a NodeRecord in `nodus-nodes`, a
NodeHealth in `nodus-health`) before the placer starts, so the placer's start measures the
load of the whole view. Then every job is applied at once (several client connections) while
a watch on `nodus-jobs` timestamps the first record of each job that says `Placed`.

The baseline is measured in the same run, on the same server, while the placer is idle: the
request/reply round trip to a trivial echo responder in its own process (one at a time, and
as a burst shaped like the apply burst), and a KV put and get round trip. Ratios relate the
placement figures to it. Speed is reported, never asserted; stdout carries one JSON object,
progress goes to stderr. Exit status 1 means the run did not complete (timeout, undecided
jobs), not that it was slow.

The JSON, by section:
  fleet, jobs        what was generated; registration time; this process's own snapshot of
                     nodes + health (the read the placer does at start)
  planner_only       the placer's Planner over the same fleet and jobs in this process, no bus:
                     the CPU floor of the decisions
  placer_start       spawn -> answers $SRV.PING (snapshot loaded); -> its watches have replayed
                     the fleet (a sentinel job is admitted, then placed)
  baseline           NATS request/reply RTT (serial and burst), KV put/get RTT, placer idle
  placement          decisions/s, apply -> Placed p50/p99 (watch-observed and as recorded in
                     status.placedTime), apply reply latency, counts, rates while applies are
                     still being answered and after
  placer_internal    the placer's own Prometheus counters over the burst (mean time in _place)
  cpu_s_during_burst CPU seconds of the placer, nats-server and this process during the burst
  ratios             the placement figures over the baseline
  replicas           how many placers ran (`--replicas`: each admits the applies the API's
                     queue group hands it and places them, all racing for the same machines)
                     and R14 checked after the burst: each job placed has one live epoch, the
                     one it names, every machine of it leased to that epoch, no machine in two
                     (a failed check makes the run fail, exit 1)

`--profile-placer FILE` runs the placer under cProfile (slower; for finding where time goes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.bench.placement_harness import (
    Options,
    Processes,
    log,
    measure,
    placer_name,
    serve_echo,
)
from tests.bench.placement_relays import BENCH_RELAYS
from tests.bench.placement_report import placer_log_summary


async def run(opts: Options) -> dict[str, Any]:
    """One bounded run: always stops what it started; `timed_out` says if it was cut short."""
    result: dict[str, Any] = {
        "bench": "placement",
        "params": {
            "machines": opts.machines,
            "jobs": opts.jobs,
            "clients": opts.clients,
            "seed": opts.seed,
            "quick": opts.quick,
            "timeout_s": opts.timeout,
            "placer_profiled": bool(opts.profile_placer),
            "placer_replicas": opts.replicas,
        },
        "environment": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "event_loop": type(asyncio.get_running_loop()).__module__.split(".")[0],
        },
        "timed_out": False,
    }
    started = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="nodus-bench-"))
    result["workdir"] = str(workdir)
    processes = Processes()
    task = asyncio.create_task(measure(opts, result, workdir, processes, started))
    try:
        done, _ = await asyncio.wait({task}, timeout=opts.timeout)
        if not done:
            result["timed_out"] = True
            result["error"] = f"the run did not finish within {opts.timeout:g}s"
            log(result["error"])
            # Python 3.11's wait_for can swallow a cancellation that races a result: insist.
            for _ in range(30):
                task.cancel()
                done, _ = await asyncio.wait({task}, timeout=1.0)
                if done:
                    break
        if done and not task.cancelled() and task.exception() is not None:
            error = task.exception()
            result["error"] = f"{type(error).__name__}: {error}"
    finally:
        if not task.done():
            task.cancel()
        processes.stop()  # idempotent; the run's own finally normally did it already
        result["placer_exit_code"] = processes.exit_codes.get("placer")
        if opts.replicas > 1:
            result["placer_exit_codes"] = [
                processes.exit_codes.get(placer_name(i)) for i in range(opts.replicas)
            ]
        placer_log = workdir / "placer.log"
        if "placer_log" not in result and placer_log.exists():
            result["placer_log"] = placer_log_summary(placer_log)
        result["total_s"] = round(time.perf_counter() - started, 3)
        if not opts.keep_dir:
            shutil.rmtree(workdir, ignore_errors=True)
            result.pop("workdir", None)
    return result


def completed(result: dict[str, Any]) -> bool:
    placement = result.get("placement", {})
    return (
        not result.get("timed_out")
        and "error" not in result
        and bool(placement)
        and placement.get("undecided") == 0
        and result.get("replicas", {}).get("ok", True)  # R14: one placement per job
    )


def print_profile(path: Path, lines: int = 30) -> None:
    import pstats

    try:
        stats = pstats.Stats(str(path), stream=sys.stderr)
    except (OSError, TypeError, EOFError) as error:
        log(f"no placer profile at {path}: {error}")
        return
    stats.sort_stats("tottime").print_stats(lines)
    stats.sort_stats("cumulative").print_stats(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m tests.bench.placement",
        description="Placement benchmark: prints one JSON object on stdout.",
    )
    parser.add_argument("--machines", type=int, help="fleet size (default 10000; --quick 1000)")
    parser.add_argument("--jobs", type=int, help="jobs applied at once (default 1000; --quick 100)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1000 machines, 100 jobs")
    parser.add_argument("--clients", type=int, default=4, help="client connections (default 4)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--timeout", type=float, help="whole-run bound in seconds (default 600)")
    parser.add_argument(
        "--apply-timeout", type=float, default=60.0, help="per-apply request timeout (default 60)"
    )
    parser.add_argument(
        "--profile-placer",
        type=Path,
        help="run the placer under cProfile, write its stats here and print the top to stderr",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="placer processes sharing the applies, racing for machines (default 1)",
    )
    parser.add_argument(
        "--relays",
        type=int,
        default=len(BENCH_RELAYS),
        help=f"relays announced before the burst (default {len(BENCH_RELAYS)}; 0: none)",
    )
    parser.add_argument("--keep-dir", action="store_true", help="keep logs and the NATS store")
    parser.add_argument("--serve-echo", metavar="URL", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def options_from(args: argparse.Namespace) -> Options:
    quick = bool(args.quick)
    return Options(
        machines=args.machines or (1_000 if quick else 10_000),
        jobs=args.jobs or (100 if quick else 1_000),
        clients=max(1, args.clients),
        seed=args.seed,
        timeout=args.timeout or (180.0 if quick else 600.0),
        apply_timeout=args.apply_timeout,
        rtt_samples=300 if quick else 1000,
        kv_samples=200 if quick else 500,
        profile_placer=args.profile_placer.resolve() if args.profile_placer else None,
        keep_dir=args.keep_dir,
        quick=quick,
        replicas=max(1, args.replicas),
        relays=max(0, min(args.relays, len(BENCH_RELAYS))),
    )


def main(argv: list[str] | None = None) -> int:
    import uvloop

    args = parse_args(argv)
    if args.serve_echo:
        uvloop.run(serve_echo(args.serve_echo))
        return 0
    opts = options_from(args)

    async def bounded() -> dict[str, Any]:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            if task is not None:
                loop.add_signal_handler(sig, task.cancel)
        return await run(opts)

    try:
        result = uvloop.run(bounded())
    except asyncio.CancelledError:
        print(json.dumps({"bench": "placement", "error": "interrupted"}))
        return 1
    print(json.dumps(result, indent=2))
    if opts.profile_placer:
        print_profile(opts.profile_placer)
    return 0 if completed(result) else 1


if __name__ == "__main__":
    sys.exit(main())

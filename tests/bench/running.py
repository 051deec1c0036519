"""Running a bench's asyncio main: uvloop when it is there, within the run's time budget, and
stoppable by SIGTERM the way Ctrl-C stops it: the main task is cancelled, so every `finally`
of the bench runs (daemons stopped, agents continued, servers closed) before it returns.

A handler that raises from a signal instead lands in whatever callback runs at that moment,
and asyncio's teardown then cancels every task at once; a bench could go on measuring, or
leave a process behind."""

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
from collections.abc import Callable, Coroutine
from pathlib import Path
from types import FrameType
from typing import Any

from tests.bus_operator import operator_credentials


def progress(bench: str) -> Callable[[str], None]:
    """The bench's progress line writer: `[bench.NAME] message` on stderr (stdout carries
    the JSON)."""

    def log(message: str) -> None:
        print(f"[bench.{bench}] {message}", file=sys.stderr, flush=True)

    return log


def bench_parser(bench: str, doc: str | None) -> argparse.ArgumentParser:
    """`python -m tests.bench.NAME`'s parser, its module docstring as the help text."""
    return argparse.ArgumentParser(
        prog=f"python -m tests.bench.{bench}",
        description=doc,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def add_run_flags(
    parser: argparse.ArgumentParser, budget: float, quick: str, keep: str = "the state dir and logs"
) -> None:
    """The flags every run has: its time budget, keeping its state, the smoke size."""
    parser.add_argument("--budget", type=float, default=budget, help="the whole run, seconds")
    parser.add_argument("--keep-state", action="store_true", help=f"keep {keep}")
    parser.add_argument("--quick", action="store_true", help=quick)


def machine_facts(**extra: Any) -> dict[str, Any]:
    """What the machine is, for figures to be compared: `loadavg_at_end` is added after."""
    return {
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        **extra,
        "loadavg_at_start": os.getloadavg(),
    }


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop when it is there, like the daemons: the harness should cost as little as it can."""
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


async def sleep_until(when: float) -> None:
    """Sleep until the monotonic clock reads `when` (at once if it is past)."""
    await asyncio.sleep(max(0.0, when - time.monotonic()))


class Interrupted(Exception):
    """SIGTERM or Ctrl-C stopped the run before it finished."""


def run_main(main: Coroutine[Any, Any, dict[str, Any]], budget: float) -> dict[str, Any]:
    """Run `main`; raises TimeoutError past `budget` seconds, Interrupted on SIGTERM or
    Ctrl-C, and whatever `main` raised."""

    async def guarded() -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        loop.add_signal_handler(signal.SIGTERM, task.cancel)
        try:
            return await asyncio.wait_for(main, budget)
        finally:
            loop.remove_signal_handler(signal.SIGTERM)
            signal.signal(signal.SIGTERM, terminate)

    try:
        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            return runner.run(guarded())
    except (asyncio.CancelledError, KeyboardInterrupt):
        raise Interrupted("stopped by SIGTERM or Ctrl-C before the run finished") from None


def terminate(signum: int, _: FrameType | None) -> None:
    """Outside the event loop (setting up, tearing down): SIGTERM as Ctrl-C."""
    raise KeyboardInterrupt(f"signal {signum}")


def run_bench(
    prefix: str,
    body: Callable[[Path], Coroutine[Any, Any, dict[str, Any]]],
    args: argparse.Namespace,
    cleanup: Callable[[], None],
) -> dict[str, Any]:
    """A whole run in a fresh state dir: the result, or {"error": why}; `elapsed_s`; the state
    dir kept (and named) when asked or when the run failed, else removed; `cleanup` always."""
    state = Path(tempfile.mkdtemp(prefix=prefix))
    result: dict[str, Any] = {}
    started = time.monotonic()
    try:
        result = run_main(body(state), args.budget)
    except TimeoutError:
        result = {"error": f"the run did not finish within its budget of {args.budget:g} s"}
    except Interrupted as stopped:
        result = {"error": str(stopped)}
    except Exception as error:
        result = {"error": f"{type(error).__name__}: {error}"}
    finally:
        cleanup()
    result["elapsed_s"] = round(time.monotonic() - started, 1)
    if args.keep_state or "error" in result:
        result["state_dir"] = str(state)
    else:
        shutil.rmtree(state, ignore_errors=True)
    return result


def bench_main(
    run: Callable[[argparse.Namespace], dict[str, Any]],
    args: argparse.Namespace,
    cleanup: Callable[[], None],
) -> int:
    """A bench's `main`: SIGTERM as Ctrl-C, the run, `cleanup` however it ends, its JSON on
    stdout; 1 when it did not complete."""
    signal.signal(signal.SIGTERM, terminate)
    try:
        # The operator's seed for the buses the bench starts (a plain shell has none).
        with operator_credentials():
            result = run(args)
    finally:
        cleanup()
    print(json.dumps(result, indent=2))
    return 1 if "error" in result else 0

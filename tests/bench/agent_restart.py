"""Agent-restart bench: the longest gap in a running TCP stream through a Relayed gang's tunnel
while the member's agent is SIGKILLed and started again (O4, issue 22).

    .venv/bin/python -m tests.bench.agent_restart           # about a minute
    .venv/bin/python -m tests.bench.agent_restart --quick   # the same, shorter windows

What runs: nats-server (authentication on), the placer and two meshed relays in this process;
two `nodus agent` daemons (a container and a VM, an Auto gang of the two is Relayed), each its
own process with its own bus user and state directory. A stream from member A's SOCKS5 entry
to an echo server on member B's address sends a 64-byte numbered message every 10 ms and
records each echo's arrival (tests/integration/agent_daemons.Stream). After `--warmup` seconds
A's agent is SIGKILLed, started again `--down` seconds later, and the stream watched for
`--after` seconds more. Per mode, on a fresh system:

  inline    the baseline, as before issue 22: the agent runs the dataplane in its own process
            (`--no-dataplane-processes`), so the tunnel and the SOCKS5 entry die with it
  process   each epoch's dataplane in a process of its own, re-adopted by the next agent

Reported per mode: `longest_gap_s` (the longest time without an echo from the kill to the end
of the window; a stream that broke counts up to the end), `broken` (and how), messages
echoed before and after the kill, whether the job's epoch changed, and
`fresh_connection_after_s` (from the restart until a new connection through the tunnel
carries bytes). `summary.gap_ratio` is inline's longest gap over process's.

Speed is reported, never asserted; stdout carries one JSON object, progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from libs.bus import Bus
from libs.bus.server import NatsServer
from libs.client.client import Client
from libs.contracts import names
from services.agent import procs
from services.placer.config import load_config
from services.placer.service import Placer
from tests.bus_operator import operator_credentials
from tests.integration.agent_daemons import Stream, agent_daemons, place_relayed_gang
from tests.integration.conftest import meshed_relays

MODES = ("inline", "process")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short windows (a smoke run)")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--down", type=float, default=2.0, help="seconds with no agent")
    parser.add_argument("--after", type=float, default=8.0, help="seconds watched after")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--keep-state", type=Path, help="keep each mode's state and logs here")
    args = parser.parse_args(argv)
    if args.quick:
        args.warmup, args.down, args.after = 1.0, 1.0, 3.0
    args.modes = [m for m in args.modes.split(",") if m]
    return args


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


async def _fresh_connection(stream_of: Stream, began: float, limit: float) -> float | None:
    """Seconds from `began` until a new connection through the tunnel echoes bytes."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        fresh = Stream(stream_of.socks, stream_of.address)
        try:
            await asyncio.wait_for(fresh.start(), 2.0)
            for _ in range(40):
                if fresh.received:
                    return time.monotonic() - began
                await asyncio.sleep(0.05)
        except (OSError, TimeoutError, AssertionError, asyncio.IncompleteReadError):
            pass
        finally:
            await fresh.close()
        await asyncio.sleep(0.2)
    return None


async def run_mode(mode: str, args: argparse.Namespace, state: Path) -> dict[str, Any]:
    server = NatsServer(state / "nats").start()
    bus = await Bus.open(
        server.url, credentials=server.credentials, buckets=names.ALL_BUCKETS, streams=True
    )
    config = load_config()
    config.distributed_access = ["acme"]
    placer = Placer(bus, config)
    relays = await meshed_relays(bus)
    extra = [] if mode == "process" else ["--no-dataplane-processes"]
    daemons = await agent_daemons(server, state, "ar", 71, extra)
    stream: Stream | None = None
    try:
        await placer.start()
        await place_relayed_gang(bus, daemons, "ar")
        a, b = daemons
        stream = Stream(a.socks, b.address)
        await stream.start()
        await asyncio.sleep(args.warmup)
        epoch_before = (await Client(bus).get_job("ar")).status.epoch
        _say(f"{mode}: SIGKILL {a.node}'s agent")
        killed = time.monotonic()
        before = stream.received
        a.signal(signal.SIGKILL)
        await asyncio.sleep(args.down)
        a.start()
        restarted = time.monotonic()
        fresh = await _fresh_connection(stream, restarted, args.after + 20)
        remaining = args.after - (time.monotonic() - restarted)
        if remaining > 0:
            await asyncio.sleep(remaining)
        end = time.monotonic()
        epoch_after = (await Client(bus).get_job("ar")).status.epoch
        return {
            "longest_gap_s": round(stream.longest_gap(since=killed, until=end), 3),
            "broken": stream.error is not None,
            "how": repr(stream.error) if stream.error is not None else None,
            "echoed_before_kill": before,
            "echoed_after_kill": stream.received - before,
            "window_s": round(end - killed, 2),
            "epoch_before": epoch_before,
            "epoch_after": epoch_after,
            "fresh_connection_after_s": round(fresh, 3) if fresh is not None else None,
        }
    finally:
        if stream is not None:
            await stream.close()
        with contextlib.suppress(Exception):
            await Client(bus).delete("ar")
        for daemon in daemons:
            daemon.stop()
            record = daemon.dataplane()
            if record is not None:
                procs.kill_group(record.pid, record.start_ticks)
        await placer.stop()
        for relay in relays:
            await relay.stop()
        await bus.close()
        server.stop()


async def run_async(args: argparse.Namespace) -> dict[str, Any]:
    result: dict[str, Any] = {"bench": "agent_restart", "modes": {}}
    for mode in args.modes:
        with tempfile.TemporaryDirectory(prefix=f"nodus-bench-restart-{mode}-") as temporary:
            state = args.keep_state / mode if args.keep_state else Path(temporary)
            state.mkdir(parents=True, exist_ok=True)
            try:
                result["modes"][mode] = await run_mode(mode, args, state)
            except Exception as error:  # one mode's failure is reported; the others run
                result["modes"][mode] = {"error": repr(error)}
    modes = result["modes"]
    gaps = {m: modes[m].get("longest_gap_s") for m in modes}
    summary: dict[str, Any] = {"longest_gap_s": gaps}
    if gaps.get("inline") and gaps.get("process"):
        summary["gap_ratio"] = round(gaps["inline"] / gaps["process"], 1)
    result["summary"] = summary
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    return asyncio.run(run_async(args))


def main(argv: Sequence[str] | None = None) -> int:
    with operator_credentials():  # the buses it starts admit this run's operator
        result = run(parse_args(argv))
    print(json.dumps(result, indent=2))
    return 1 if any("error" in m for m in result["modes"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())

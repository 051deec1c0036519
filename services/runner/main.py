"""`nodus runner`: probes placed epochs, qualifies their network, runs the gang to the end.
Called the prober until this release: `nodus prober` still starts it, with a warning, and its
metrics are exported under their old names too (`nodus_prober_*`), for one release."""

from __future__ import annotations

import argparse
import asyncio
import logging

from libs.bus import Bus
from libs.contracts import names
from libs.contracts.bounds import HEARTBEAT_TIMEOUT_SECONDS
from libs.runtime import add_common_flags, run_daemon
from services.runner.metrics import export_old_names
from services.runner.service import Runner

log = logging.getLogger("nodus.runner")


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Before a gang's command starts, every member checks its path to every other member "
        "(3 fresh TCP connections each way, RTT, a TCP throughput sample, the path class) in "
        "rounds; the slowest pair is published and sets NetworkQualified; then the ranks are "
        "launched and watched to the end. Run several replicas: each epoch is probed by one of them "
        "at a time, and taken over (probed again from the start) if that one dies."
    )
    add_common_flags(parser, metrics_port=0)
    parser.add_argument("--replica", help="this replica's name in records (default: random)")
    parser.add_argument(
        "--sample-seconds",
        type=float,
        default=10.0,
        help="TCP throughput sample per pair (default 10)",
    )
    parser.add_argument(
        "--readiness-seconds", type=float, default=60.0, help="readiness window (default 60)"
    )
    parser.add_argument(
        "--takeover-seconds",
        type=float,
        default=HEARTBEAT_TIMEOUT_SECONDS,
        help="take over an epoch's probe whose runner has not renewed its heartbeat for this "
        f"long (default {HEARTBEAT_TIMEOUT_SECONDS:g}); a replica restarted under its "
        "--replica name takes its own back at once",
    )


async def _body(args: argparse.Namespace, stop: asyncio.Event) -> None:
    bus = await Bus.open(
        args.nats,
        name="nodus-runner",
        credentials=args.credentials,
        buckets=names.ALL_BUCKETS,
        streams=True,
    )
    runner = Runner(
        bus, args.replica, args.sample_seconds, args.readiness_seconds, args.takeover_seconds
    )
    try:
        await runner.start()
        await stop.wait()
    finally:
        await runner.stop()
        await bus.close()


def run(args: argparse.Namespace) -> int:
    export_old_names()
    return run_daemon("runner", args, _body)


def run_as_prober(args: argparse.Namespace) -> int:
    """`nodus prober`, the old name: the same daemon, and a warning in its log."""

    async def body(args: argparse.Namespace, stop: asyncio.Event) -> None:
        log.warning(
            "`nodus prober` is deprecated and goes in the next release: the service is "
            "`nodus runner` (its systemd unit nodus-runner.service, its metrics nodus_runner_*)"
        )
        await _body(args, stop)

    export_old_names()
    return run_daemon("runner", args, body)

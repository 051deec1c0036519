"""`nodus remediator`: alerts, recommendations, policy, guardrails, repairs, revalidation."""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import secrets
from datetime import timedelta
from pathlib import Path

from libs.bus import Bus
from libs.contracts import names
from libs.contracts.base import now as utc_now
from libs.runtime import add_common_flags, run_daemon
from services.remediator.alerts import AlertSettings
from services.remediator.guardrails import Settings
from services.remediator.provider import LabProviderFactory
from services.remediator.providers.config import load_config
from services.remediator.providers.router import PoolProviders
from services.remediator.service import Remediator

BUCKETS = [
    *names.REMEDIATION_BUCKETS,
    names.BUCKET_NODES,
    names.BUCKET_HEALTH,
    names.BUCKET_LEASES,
    names.BUCKET_JOBS,
]


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Turn detector signals into alerts with evidence, alerts into recommendations under "
        "the repair policy (approve-before-repair by default: `nodus approve ID`), and run "
        "approved repairs on the lightest rung of the ladder when the node is idle, within "
        "the guardrails (persistence, cooldown, budget, one repair per pool, circuit breaker). "
        "Repaired machines rejoin only after diagnostics pass. Run several replicas: they "
        "settle every race with compare-and-set writes."
    )
    add_common_flags(parser, metrics_port=0)
    parser.add_argument("--replica", help="this replica's name in records (default: random)")
    parser.add_argument(
        "--config",
        type=Path,
        help="the remediator's YAML config: `providers:` maps each node pool ('*' for the "
        "rest) to how repairs reach its machines (inband, redfish, exec; see README). "
        "Without one every pool uses the local provider, which only rewrites lab files "
        "(nodus up)",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=Path(os.environ.get("NODUS_STATE_DIR", ".nodus")),
        help="the local fleet's files for the embedded machine provider (STATE_DIR/machines/"
        "NAME, STATE_DIR/hosts/HOST); env NODUS_STATE_DIR, default .nodus",
    )
    parser.add_argument(
        "--persistence-seconds",
        type=float,
        default=120.0,
        help="how long a signal must persist before it is recommended (default 120)",
    )
    parser.add_argument(
        "--flap-memory-seconds",
        type=float,
        default=600.0,
        help="a signal back within this keeps its persistence window (default 600)",
    )
    parser.add_argument(
        "--cooldown-seconds",
        type=float,
        default=1800.0,
        help="no new repair of a node within this of its last one (default 1800)",
    )
    parser.add_argument(
        "--budget-fraction",
        type=float,
        default=0.05,
        help="share of a cluster's nodes repaired at once (default 0.05, at least 1)",
    )
    parser.add_argument(
        "--breaker-surge",
        type=int,
        default=5,
        help="automatic repairs in one cluster within the window that open its breaker",
    )
    parser.add_argument("--breaker-fraction", type=float, default=0.02)
    parser.add_argument("--breaker-window-seconds", type=float, default=600.0)
    parser.add_argument(
        "--external-cap", type=int, default=3, help="active external repairs per cluster"
    )
    parser.add_argument(
        "--min-available",
        type=float,
        default=0.5,
        help="external requests keep at least this share of a cluster in service",
    )
    parser.add_argument("--action-timeout-seconds", type=float, default=900.0)
    parser.add_argument("--tick-seconds", type=float, default=1.0)


def settings_of(args: argparse.Namespace) -> Settings:
    return Settings(
        persistence=timedelta(seconds=args.persistence_seconds),
        cooldown=timedelta(seconds=args.cooldown_seconds),
        budget_fraction=args.budget_fraction,
        breaker_surge=args.breaker_surge,
        breaker_fraction=args.breaker_fraction,
        breaker_window=timedelta(seconds=args.breaker_window_seconds),
        external_cap=args.external_cap,
        min_available_fraction=args.min_available,
        action_timeout=timedelta(seconds=args.action_timeout_seconds),
    )


async def _body(
    args: argparse.Namespace, stop: asyncio.Event, lab: LabProviderFactory | None = None
) -> None:
    config = load_config(args.config)  # a bad file stops the daemon before it connects (S3)
    replica = args.replica or f"remediator-{secrets.token_hex(3)}"
    bus = await Bus.open(
        args.nats,
        name="nodus-remediator",
        credentials=args.credentials,
        buckets=BUCKETS,
        streams=True,
    )
    remediator = Remediator(
        bus,
        PoolProviders(bus, config, args.state_dir, replica, utc_now, lab=lab),
        settings_of(args),
        replica=replica,
        alert_settings=AlertSettings(flap_memory=timedelta(seconds=args.flap_memory_seconds)),
        tick_seconds=args.tick_seconds,
    )
    try:
        await remediator.start()
        await stop.wait()
    finally:
        await remediator.stop()
        await bus.close()


def run(args: argparse.Namespace, lab: LabProviderFactory | None = None) -> int:
    """`lab`: the lab's machine provider, for pools whose provider is `local` (nodus up)."""
    return run_daemon("remediator", args, functools.partial(_body, lab=lab))

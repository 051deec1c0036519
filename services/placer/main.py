"""`nodus placer`: admission, placement, epochs, join keys, ranktables and rank environments."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from libs.bus import Bus
from libs.contracts import names
from libs.runtime import add_common_flags, run_daemon
from services.placer.config import load_config
from services.placer.service import Placer


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Admit distributed Jobs, place their gangs, open epochs with fresh mesh identities and "
        "join keys, and write ranktables and rank environments. Run several replicas side by "
        "side: they share work through a NATS queue group and settle races with "
        "compare-and-set writes."
    )
    add_common_flags(parser, metrics_port=0)
    parser.add_argument(
        "--config",
        type=Path,
        help="placer settings YAML (beta access, Relayed limit, qualification table); "
        "default: the built-in services/placer/default-config.yaml",
    )
    parser.add_argument("--replica", help="this replica's name in records (default: random)")
    parser.add_argument(
        "--shim-path", help="path of libnodus-netshim.so on the members (overrides the config)"
    )
    parser.add_argument(
        "--checkpoint-root",
        help="a directory every machine mounts: each job's NODUS_CHECKPOINT_DIR is "
        "ROOT/ORG/NAME/ADMITTED, kept across its epochs (overrides the config)",
    )


async def _body(args: argparse.Namespace, stop: asyncio.Event) -> None:
    config = load_config(args.config)
    if args.shim_path:
        config.shim_path = args.shim_path
    if args.checkpoint_root:
        config.checkpoint_root = args.checkpoint_root
    bus = await Bus.open(
        args.nats,
        name="nodus-placer",
        credentials=args.credentials,
        buckets=names.ALL_BUCKETS,
        streams=True,
    )
    placer = Placer(bus, config, replica=args.replica)
    try:
        await placer.start()
        await stop.wait()
    finally:
        await placer.stop()
        await bus.close()


def run(args: argparse.Namespace) -> int:
    return run_daemon("placer", args, _body)

"""`nodus up` (the whole system on this machine), `nodus demo` and `nodus schema`."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from pathlib import Path

import msgspec

from app.cli.common import Command, run_async
from libs.contracts import names


def _nats_cluster_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nats-cluster",
        type=int,
        default=1,
        metavar="N",
        help="run N nats-servers clustered with JetStream (3 or more; streams and buckets keep "
        "3 copies) instead of one: the bus outlives the loss of any one server",
    )


def _up_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--fleet", type=Path, help="fleet file (default: examples/fleet.yaml)")
    parser.add_argument(
        "--nats-port",
        type=int,
        default=names.NATS_PORT,
        help=f"NATS port (default {names.NATS_PORT})",
    )
    parser.add_argument("--state-dir", type=Path, default=Path(".nodus"), help="default .nodus")
    parser.add_argument("--placers", type=int, default=1, help="placer replicas (default 1)")
    _nats_cluster_flag(parser)
    parser.add_argument(
        "--netns",
        action="store_true",
        help="each machine in a network namespace of its own, providers' LANs, NAT and "
        "private networks as the fleet says (root; e.g. examples/fleet-netns.yaml): VMs get "
        "nodus0 and the Direct path",
    )
    parser.add_argument(
        "--detector",
        action="append",
        default=[],
        metavar="NAME",
        help="a bus user for an external detector (R8), printed as NODUS_CREDENTIALS for it: "
        "it may only ask repairs and label nodes, as NAME",
    )
    parser.add_argument(
        "--prometheus",
        action="store_true",
        help="also run Debian's Prometheus on STATE_DIR/prometheus/targets.json (every daemon "
        "serves /metrics; the file is written either way)",
    )


async def _up(args: argparse.Namespace) -> int:
    from app.local import DEFAULT_FLEET, LocalSystem

    system = LocalSystem(
        fleet_path=args.fleet or DEFAULT_FLEET,
        state_dir=args.state_dir,
        nats_port=args.nats_port,
        placers=args.placers,
        netns=args.netns,
        prometheus=args.prometheus,
        detectors=args.detector,
        nats_cluster=args.nats_cluster,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await system.start()
        assert system.fleet is not None
        assert system.nats is not None
        print(f"NODUS_NATS_URL={system.url}", flush=True)
        # The operator's bus user: `export` both, and the CLI reaches this bus (S1).
        print(f"NODUS_CREDENTIALS={system.nats.credentials}", flush=True)
        for detector in args.detector:
            seed = system.detector_credentials(detector)
            print(f"# detector {detector}: NODUS_CREDENTIALS={seed}", flush=True)
        if system.prometheus:
            print(
                f"NODUS_PROMETHEUS_URL=http://{system.prometheus_host}:{system.prometheus_port}",
                flush=True,
            )
        print(
            f"# {len(system.fleet.machines)} machines, {args.placers} placer(s); "
            f"logs in {args.state_dir / 'logs'}; Ctrl-C stops everything",
            file=sys.stderr,
            flush=True,
        )
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=1.0)
            except TimeoutError:
                for name, code in system.restart_exited():
                    if code is None:
                        print(f"# {name} keeps exiting: left down", file=sys.stderr)
                    else:
                        print(f"# {name} exited ({code}); started it again", file=sys.stderr)
    finally:
        system.stop()
    return 0


def _demo_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--state-dir",
        type=Path,
        help="keep the system's files (logs/ included) here; default: a temporary directory",
    )
    parser.add_argument(
        "--netns",
        action="store_true",
        help="every machine in a network namespace (root; examples/fleet-netns.yaml), so the "
        "Direct gang runs over nodus0 too",
    )
    _nats_cluster_flag(parser)


async def _demo(args: argparse.Namespace) -> int:
    from app.demo import run_demo

    return await run_demo(args.state_dir, args.netns, args.nats_cluster)


def _schema_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", help="one schema (Job, Fleet, Epoch, ...)")


def _schema(args: argparse.Namespace) -> int:
    import libs.contracts as contracts
    from libs.contracts.base import Record

    kinds = {
        name: kind
        for name in contracts.__all__
        if isinstance(kind := getattr(contracts, name), type) and issubclass(kind, Record)
    }
    if args.name:
        if args.name not in kinds:
            print(
                f"error: no schema {args.name!r}; one of {', '.join(sorted(kinds))}",
                file=sys.stderr,
            )
            return 2
        print(json.dumps(msgspec.json.schema(kinds[args.name]), indent=2))
        return 0
    _, components = msgspec.json.schema_components(list(kinds.values()))
    print(json.dumps(components, indent=2))
    return 0


LOCAL = [
    Command("up", "run the whole system on this machine until Ctrl-C", _up_flags, run_async(_up)),
    Command(
        "demo",
        "the main job end to end on the embedded fleet, then exit",
        _demo_flags,
        run_async(_demo),
    ),
]
SCHEMA = Command("schema", "JSON Schemas of every record and message", _schema_flags, _schema)

"""`nodus bus init|user`: the files of a real, clustered, confined bus (S1, deploy/nats)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from app.cli.common import Command, group
from libs.bus.auth import DETECTOR, RELAY, SERVICE
from libs.bus.cluster import add_machine, add_user, parse_server, write_cluster
from libs.contracts.errors import NodusError


def _init_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", type=Path, required=True, help="where to write the bus's files")
    parser.add_argument(
        "--server",
        action="append",
        default=[],
        metavar="NAME=HOST[:PORT[:ROUTE_PORT]]",
        help="a NATS server of the cluster (three or more); ports 4222 and 6222 by default",
    )
    parser.add_argument("--relay", action="append", default=[], metavar="NAME", help="a relay")
    parser.add_argument(
        "--agent", action="append", default=[], metavar="NODE", help="a machine's agent"
    )
    parser.add_argument(
        "--installed-at",
        type=Path,
        default=Path("/etc/nats"),
        help="where each server's files will be on it (default /etc/nats)",
    )
    parser.add_argument(
        "--store-dir", type=Path, default=Path("/var/lib/nats"), help="JetStream's directory"
    )
    parser.add_argument(
        "--here",
        action="store_true",
        help="the configurations name the files where they are written (all servers on "
        "this machine: a trial run)",
    )
    parser.add_argument("--listen-host", default="0.0.0.0", help="address the servers bind")


def _init(args: argparse.Namespace) -> int:
    try:
        servers = [parse_server(s) for s in args.server]
        users = write_cluster(
            args.dir,
            servers,
            args.relay,
            args.agent,
            installed_at=None if args.here else args.installed_at,
            store_dir=args.store_dir,
            listen_host=args.listen_host,
        )
    except NodusError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    urls = ",".join(f"tls://{s.host}:{s.client_port}" for s in servers)
    print(
        f"# the bus's files are in {args.dir}: copy servers/NAME/ to each server's "
        f"{args.installed_at}, each user's seed to its machine (deploy/nats/README.md)"
    )
    print(f"NODUS_NATS_URL={urls}")
    print(f"NODUS_NATS_CA={(args.dir / 'ca.pem').resolve()}")
    print(f"NODUS_CREDENTIALS={users.seed_file('operator').resolve()}")
    print("NODUS_BUS_REPLICAS=3")
    return 0


def _user_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", type=Path, required=True, help="the directory of `bus init`")
    who = parser.add_mutually_exclusive_group(required=True)
    who.add_argument(
        "--agent", metavar="NODE", help="a new machine: its agent's and its monitor's users"
    )
    who.add_argument("--relay", metavar="NAME", help="a new relay")
    who.add_argument("--service", metavar="NAME", help="another service replica's user")
    who.add_argument(
        "--detector", metavar="NAME", help="an external detector: asks repairs as NAME (R8)"
    )


def _user(args: argparse.Namespace) -> int:
    if args.agent:
        return _machine(args.dir, args.agent)
    if args.relay:
        name, role, node = f"relay-{args.relay}", RELAY, args.relay
    elif args.detector:
        name, role, node = f"detector-{args.detector}", DETECTOR, args.detector
    else:
        name, role, node = args.service, SERVICE, None
    try:
        seed = add_user(args.dir, name, role, node)
    except NodusError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(
        f"# {name}'s seed: {seed}; copy servers/*/authorization.conf to the servers and "
        "run `nats-server --signal reload` on each"
    )
    print(f"NODUS_CREDENTIALS={seed.resolve()}")
    return 0


def _machine(directory: Path, node: str) -> int:
    try:
        agent, monitor = add_machine(directory, node)
    except NodusError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(
        f"# {node}'s seeds: copy {agent} to it as /etc/nodus/credentials/nats.nk (the agent) "
        f"and {monitor} as /etc/nodus/credentials/monitor.nk (its monitor), mode 0600; copy "
        "servers/*/authorization.conf to the servers and run `nats-server --signal reload` on each"
    )
    print(f"NODUS_CREDENTIALS={agent.resolve()}")
    return 0


BUS = group(
    "bus",
    "the files of a clustered bus with TLS and a user per process (S1)",
    "bus_command",
    [
        Command("init", "a three-node NATS cluster: TLS, JetStream R3, users", _init_flags, _init),
        Command(
            "user", "add a machine's agent, a relay, a detector or a service", _user_flags, _user
        ),
    ],
)

"""The `nodus` parser: every subject's commands on one argparse parser, and `main`.

`get` and `describe` are shared by subjects: each subject lists its kinds (`GET_KINDS`,
`DESCRIBE_KINDS`) and the chosen kind's code runs."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from app.cli import daemons
from app.cli.common import Command, Kind, client_flags, output_flag, run_async

GET_FORMATS = "json|yaml|jsonpath=... (default, or wide: a table; YAML for ranktables)"


def kinds_command(name: str, help: str, kinds: Sequence[Kind], get: bool) -> Command:
    """`nodus get KIND [NAME]` or `nodus describe KIND NAME`, of the subjects' `kinds`."""
    by_name = {kind.name: kind for kind in kinds}

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("kind", choices=list(by_name))
        parser.add_argument("name", nargs="?" if get else None)
        if get:
            parser.add_argument(
                "-w", "--watch", action="store_true", help="keep printing changes (job)"
            )
            output_flag(parser, GET_FORMATS)
        client_flags(parser)
        if get:
            parser.add_argument("--node", help="alerts, recommendations, remediations: of one node")
            parser.add_argument(
                "--all", action="store_true", help="alerts and remediations: resolved and ended too"
            )

    async def show(args: argparse.Namespace) -> int:
        return await by_name[args.kind].show(args)

    return Command(name, help, add_arguments, run_async(show))


def commands() -> list[Command]:
    """Every command, in the order `nodus --help` lists them."""
    from app.cli import bus, jobs, qualify, relays, repair, system

    get = kinds_command(
        "get",
        "list jobs, nodes or relays, or show one job",
        [*jobs.GET_KINDS, *relays.GET_KINDS, *qualify.GET_KINDS, *repair.GET_KINDS],
        True,
    )
    describe = kinds_command(
        "describe",
        "a job in full: members, plan bounds, conditions, events",
        [*jobs.DESCRIBE_KINDS, *repair.DESCRIBE_KINDS],
        False,
    )
    return [
        *system.LOCAL,
        bus.BUS,
        jobs.APPLY,
        get,
        describe,
        *jobs.COMMANDS,
        qualify.QUALIFY,
        system.SCHEMA,
        *daemons.JOB_DAEMONS,
        *repair.commands(),
        *daemons.REPAIR_DAEMONS,
    ]


def build_parser(every: Sequence[Command] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nodus",
        description="Nodus places distributed GPU jobs as gangs, joins their members into a "
        "private network per epoch, and hands every rank its environment.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in commands() if every is None else every:
        command.attach(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else argv
    # A daemon's command alone: it starts on every machine, and imports only its service.
    daemon = daemons.BY_NAME.get(given[0]) if given else None
    every = [daemon] if daemon is not None else commands()
    args = build_parser(every).parse_args(given)
    return next(c for c in every if c.name == args.command).run(args)

"""What every `nodus` command shares: the bus flags, `-o` and how it renders, the AGE column,
and the command registry (a command, a group of subcommands, a kind of `get` or `describe`).

The subject modules (`jobs`, `repair`, `system`, `daemons`) each list their commands;
`app.cli.parser` puts them on one argparse parser."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from app.output import jsonpath, to_json, to_yaml
from libs.contracts.errors import NodusError
from libs.runtime.service import add_bus_flags

Run = Callable[[argparse.Namespace], int]
AsyncBody = Callable[[argparse.Namespace], Coroutine[Any, Any, int]]

# -- the registry ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    """`nodus NAME`: its flags (`add_arguments`) and what runs it (`run`, the exit code)."""

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Run
    description: str | None = None

    def attach(self, sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
        self.add_arguments(sub.add_parser(self.name, help=self.help, description=self.description))


@dataclass(frozen=True)
class Kind:
    """A KIND of `nodus get KIND` or `nodus describe KIND`, and the subject's code that shows it."""

    name: str
    show: AsyncBody


def add_commands(
    parser: argparse.ArgumentParser, dest: str, commands: Sequence[Command], metavar: str
) -> None:
    """`commands` as the subcommands of `parser`; the one chosen is `args.<dest>`."""
    sub = parser.add_subparsers(dest=dest, required=True, metavar=metavar)
    for command in commands:
        command.attach(sub)


def group(name: str, help: str, dest: str, commands: Sequence[Command]) -> Command:
    """`nodus NAME SUBCOMMAND ...`: a command made of subcommands (`nodus policy get|set`)."""
    by_name = {command.name: command for command in commands}

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        add_commands(parser, dest, commands, metavar="|".join(by_name))

    def run(args: argparse.Namespace) -> int:
        return by_name[getattr(args, dest)].run(args)

    return Command(name, help, add_arguments, run)


def run_async(body: AsyncBody) -> Run:
    """A client command's body run to its exit code: a NodusError is one `error:` line (1)."""

    def run(args: argparse.Namespace) -> int:
        try:
            return asyncio.run(body(args))
        except NodusError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 130

    return run


# -- flags ---------------------------------------------------------------------------------------


def client_flags(parser: argparse.ArgumentParser, org: bool = True) -> None:
    """How a client command reaches the bus; `--org` where a job name is looked up."""
    add_bus_flags(parser)
    if org:
        parser.add_argument("--org", help="the job's org, needed only when two orgs use one name")


DOCUMENT_FORMATS = "json|yaml|jsonpath=..."


def output_flag(
    parser: argparse.ArgumentParser, formats: str = DOCUMENT_FORMATS, default: str = ""
) -> None:
    """`-o/--output`; `render` is what the document formats print."""
    parser.add_argument("-o", "--output", default=default, help=f"output format: {formats}")


# -- output --------------------------------------------------------------------------------------


def render(document: Any, output: str) -> str | None:
    """`document` as `-o` asks: json, yaml or jsonpath=TEMPLATE (kubectl's form). None for
    any other value (none, `wide`): the command prints its own view, a table."""
    if output == "json":
        return to_json(document)
    if output == "yaml":
        return to_yaml(document)
    if output.startswith("jsonpath="):
        return jsonpath(output.removeprefix("jsonpath=").strip("'\""), document)
    return None


def emit(document: Any, output: str) -> bool:
    """Print `render(document, output)`; False when the command's own view is wanted."""
    text = render(document, output)
    if text is None:
        return False
    print(text)
    return True


def age(when: datetime | None, now: datetime | None = None) -> str:
    """The AGE column: 59s, 5m (from 2 minutes), 3h (from 2 hours; 72h after three days)."""
    if when is None:
        return "-"
    seconds = int(((now or datetime.now(UTC)) - when).total_seconds())
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h"


def indented(text: str, prefix: str = "  ") -> list[str]:
    """A table's lines under a `Heading:` line of `nodus describe`."""
    return [prefix + line for line in text.splitlines()]


def short(text: str, width: int = 60) -> str:
    """`text` cut to `width` characters, an ellipsis last when cut."""
    return text if len(text) <= width else text[: width - 1] + "…"


def needs_name(args: argparse.Namespace) -> bool:
    """`nodus get KIND` of one thing without its NAME: said, and True."""
    if args.name:
        return False
    print(f"error: `nodus get {args.kind}` needs a NAME", file=sys.stderr)
    return True

"""`nodus placer|agent|relay|runner|remediator|monitor`: run a service. Each service's module
has `build_parser(parser)` (its flags; `--nats`, credentials and metrics from libs.runtime) and
`run(args)`.

A service's module is imported only when its command is built or run: `nodus agent` starts
on every machine and `nodus up` starts a dozen daemons, and none needs the others' modules
(the remediator's alone pulls in sushy and requests)."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from app.cli.common import Command


def simulate_machine(directory: Path, gpus: int) -> None:
    from app.lab import faults

    faults.ensure_baseline(directory, gpus=gpus)


def _lab_provider() -> Any:
    from app.lab.provider import LocalProvider

    return LocalProvider


def service(
    name: str,
    help: str,
    module: str,
    run: str = "run",
    handed: Callable[[], dict[str, Any]] = dict,
) -> Command:
    """`nodus NAME`, run by `module`'s `run` (with the keyword arguments `handed` makes),
    the module imported when the command is built or run."""

    def add_arguments(parser: argparse.ArgumentParser) -> None:
        importlib.import_module(module).build_parser(parser)

    def start(args: argparse.Namespace) -> int:
        code: int = getattr(importlib.import_module(module), run)(args, **handed())
        return code

    return Command(name, help, add_arguments, start)


JOB_DAEMONS = [
    service("placer", "daemon: admission and placement", "services.placer.main"),
    service("agent", "daemon: the per-machine agent", "services.agent.main"),
    service("relay", "daemon: a relay for Relayed gangs", "services.relay.main"),
    service("runner", "daemon: probes, qualification, the gang's run", "services.runner.main"),
    # The runner's name until this release; removed in the next.
    service(
        "prober",
        "daemon: the runner's old name (deprecated; use `nodus runner`)",
        "services.runner.main",
        run="run_as_prober",
    ),
]
REPAIR_DAEMONS = [
    # The lab's machine provider and machines are handed in: no service imports the lab.
    service(
        "remediator",
        "daemon: automated node repair",
        "services.remediator.main",
        handed=lambda: {"lab": _lab_provider()},
    ),
    service(
        "monitor",
        "daemon: the fault detectors of machines",
        "services.monitor.monitor",
        handed=lambda: {"simulate": simulate_machine},
    ),
]
BY_NAME = {command.name: command for command in JOB_DAEMONS + REPAIR_DAEMONS}

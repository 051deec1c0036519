"""`nodus placer|agent|relay|runner|remediator|monitor`: run a service. Each service's module
has `build_parser(parser)` (its flags; `--nats`, credentials and metrics from libs.runtime) and
`run(args)`."""

from __future__ import annotations

import functools
from pathlib import Path

from app.cli.common import Command
from app.lab import faults
from app.lab.provider import LocalProvider
from services.agent import main as agent
from services.monitor import monitor
from services.placer import main as placer
from services.relay import main as relay
from services.remediator import main as remediator
from services.runner import main as runner


def simulate_machine(directory: Path, gpus: int) -> None:
    faults.ensure_baseline(directory, gpus=gpus)


JOB_DAEMONS = [
    Command("placer", "daemon: admission and placement", placer.build_parser, placer.run),
    Command("agent", "daemon: the per-machine agent", agent.build_parser, agent.run),
    Command("relay", "daemon: a relay for Relayed gangs", relay.build_parser, relay.run),
    Command(
        "runner",
        "daemon: probes, qualification, the gang's run",
        runner.build_parser,
        runner.run,
    ),
    # The runner's name until this release; removed in the next.
    Command(
        "prober",
        "daemon: the runner's old name (deprecated; use `nodus runner`)",
        runner.build_parser,
        runner.run_as_prober,
    ),
]
REPAIR_DAEMONS = [
    # The lab's machine provider and machines are handed in: no service imports the lab.
    Command(
        "remediator",
        "daemon: automated node repair",
        remediator.build_parser,
        functools.partial(remediator.run, lab=LocalProvider),
    ),
    Command(
        "monitor",
        "daemon: the fault detectors of machines",
        monitor.build_parser,
        functools.partial(monitor.run, simulate=simulate_machine),
    ),
]

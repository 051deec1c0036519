"""A deliberately broken build of one daemon, for the chaos harness's own tests: the harness
must fail, naming the violation, when the system is broken. `LocalSystem.module` runs this
instead of `app` for the daemons it names; `NODUS_CHAOS_DEFECT` says which defect:

- `runner-fails-all`: the runner concludes every gang's run Failed;
- `placer-refuses-every-third`: the placer refuses every third apply;
- `relay-never-restarts`: a relay started a second time (after a kill) exits at once.

    python -m tests.chaos.broken <the daemon's `python -m app` arguments>
"""

from __future__ import annotations

import os
import sys
from datetime import datetime
from itertools import count
from pathlib import Path

from app.cli.parser import main
from libs.contracts.api import ApplyReply, ApplyRequest
from libs.contracts.errors import ErrorCode, NodusError
from services.placer.service import Placer
from services.runner.run import GangRun

DEFECT_VARIABLE = "NODUS_CHAOS_DEFECT"


def runner_fails_all() -> None:
    finish = GangRun._finish

    async def failed(
        self: GangRun,
        gang: str,
        epoch: int,
        succeeded: bool,
        reason: str,
        message: str,
        t: datetime,
    ) -> None:
        await finish(self, gang, epoch, False, reason, f"broken build: {message}", t)

    GangRun._finish = failed  # type: ignore[method-assign]


def placer_refuses_every_third() -> None:
    apply = Placer.apply
    calls = count(1)

    async def refusing(self: Placer, request: ApplyRequest) -> ApplyReply:
        if next(calls) % 3 == 0:
            raise NodusError(ErrorCode.INTERNAL, "broken build: every third apply is refused")
        return await apply(self, request)

    Placer.apply = refusing  # type: ignore[method-assign]


def relay_never_restarts(argv: list[str]) -> None:
    name = argv[argv.index("--name") + 1] if "--name" in argv else "relay"
    marker = Path(os.environ.get("NODUS_CHAOS_STATE", ".")) / f"broken-{name}.started"
    if marker.exists():
        print(f"broken build: {name} does not start again", file=sys.stderr)
        sys.exit(1)
    marker.write_text("started once\n")


def run(argv: list[str]) -> int:
    defect = os.environ.get(DEFECT_VARIABLE, "")
    if defect == "runner-fails-all":
        runner_fails_all()
    elif defect == "placer-refuses-every-third":
        placer_refuses_every_third()
    elif defect == "relay-never-restarts":
        relay_never_restarts(argv)
    else:
        print(f"{DEFECT_VARIABLE}={defect!r} is no defect this build knows", file=sys.stderr)
        return 2
    return main(argv)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))

"""Admission: refuse early, with a readable reason, what can never run (G1, G2, G8, C4-C6)."""

from __future__ import annotations

import re
from collections.abc import Iterable

from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.fleet import NodeRecord
from libs.contracts.jobs import QUALIFY_ORG, Job, PathClass
from services.placer.candidates import Candidates
from services.placer.environment import check_backend_names
from services.placer.planner import Planner, Shortfall

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def check_static(job: Job, planner: Planner) -> None:
    """Rules that need no cluster view."""
    config = planner.config
    org = job.metadata.org
    if not config.has_access(org) and org != QUALIFY_ORG:  # the operators' own runs
        raise NodusError(
            ErrorCode.ACCESS_DENIED,
            f"org {org!r} has no access to distributed jobs, which are in beta behind per-org "
            "access; ask for access from the console",
            field="$.metadata.org",
        )
    for source, env in (("spec.env", job.spec.env), ("spec.image.env", job.spec.image.env)):
        for name, value in env.items():
            if not ENV_NAME.match(name):
                raise NodusError(
                    ErrorCode.INVALID,
                    f"{source}: {name!r} is not a valid environment variable name",
                    field=f"$.{source}",
                )
            if "\x00" in value:
                raise NodusError(
                    ErrorCode.INVALID,
                    f"{source}.{name} contains a NUL byte",
                    field=f"$.{source}.{name}",
                )
    if job.spec.distributed.transport == "Auto" and "LD_PRELOAD" in job.spec.env:
        raise NodusError(
            ErrorCode.LD_PRELOAD_WITH_AUTO,
            "spec.env.LD_PRELOAD is refused with transport: Auto: on a Relayed path Nodus "
            "preloads its shim first; put your library in the image's LD_PRELOAD "
            "(spec.image.env), which is kept after the shim, or use transport: Direct",
            field="$.spec.env.LD_PRELOAD",
        )
    if job.spec.accelerators.backend is not None:
        check_backend_names(job, job.spec.accelerators.backend)
    if job.spec.qualify is not None:
        if org != QUALIFY_ORG:
            raise NodusError(
                ErrorCode.INVALID,
                f"spec.qualify: qualification runs belong to the org {QUALIFY_ORG!r} "
                "(`nodus qualify`), not to {org!r}",
                field="$.spec.qualify",
            )
        if job.spec.distributed.members != 2 and job.spec.qualify.path is not PathClass.RELAYED:
            raise NodusError(
                ErrorCode.INVALID,
                "spec.qualify: a qualification run measures one pair: members must be 2 (a "
                "Relayed run may measure a gang of up to 8)",
                field="$.spec.distributed.members",
            )


def check_feasible(job: Job, planner: Planner, fleet: Iterable[NodeRecord] | Candidates) -> None:
    """Could this job be placed on the registered fleet if it were idle? If not, refuse now."""
    plan, shortfalls = planner.plan(job, fleet if isinstance(fleet, Candidates) else list(fleet))
    if plan is None:
        raise refusal(shortfalls)


def refusal(shortfalls: list[Shortfall]) -> NodusError:
    """The most specific code among the paths' shortfalls, and every path's reason."""
    code = next(
        (s.code for s in shortfalls if s.code is not ErrorCode.UNSATISFIABLE),
        ErrorCode.UNSATISFIABLE,
    )
    message = "cannot be placed on this fleet: " + "; ".join(s.message for s in shortfalls)
    return NodusError(code, message)

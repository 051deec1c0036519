"""R16: repairing a node of a running gang restarts the gang in a new epoch. The gang's job
goes back to placement without the node (`status.avoid`); the placer fences the old epoch
first, then places the next one, as it does when a member is lost."""

from __future__ import annotations

import logging
from datetime import datetime

import msgspec

from libs.bus import Bus
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.epochs import Lease
from libs.contracts.jobs import ConditionType, Job, Phase, with_condition

log = logging.getLogger("nodus.remediator")
RUNNING_PHASES = (Phase.PLACED, Phase.PROBING, Phase.RUNNING)


async def restart_gangs(bus: Bus, node: str, leases: list[Lease], remediation_id: str) -> None:
    jobs = bus.bucket(names.BUCKET_JOBS, Job)
    for lease in leases:
        message = (
            f"{node} is being repaired (remediation {remediation_id}); epoch {lease.epoch} ends "
            "and the gang is placed again without it"
        )
        t = now()

        def replace(
            job: Job | None, lease: Lease = lease, message: str = message, t: datetime = t
        ) -> Job | None:
            if job is None or job.status.epoch != lease.epoch:
                return None
            if job.status.phase not in RUNNING_PHASES:
                return None
            status = with_condition(
                job.status, ConditionType.GANG_READY, "False", "NodeRepair", message, t
            )
            status = msgspec.structs.replace(
                status, phase=Phase.PENDING, avoid=[*status.avoid, node]
            )
            return msgspec.structs.replace(job, status=status)

        try:
            if await jobs.mutate(lease.gang, replace) is not None:
                log.warning("%s: %s", lease.gang, message)
        except Exception as error:  # the job moved on; the placer's member checks remain
            log.warning("could not restart %s for the repair of %s: %s", lease.gang, node, error)

"""What every service does to a gang that lost a member (R16, R17): its job goes back to
placement without the machine (`status.avoid`), if that epoch is still its current one and
active; the placer fences the old epoch first, then places the next. The job's events say
why."""

from __future__ import annotations

import logging
from datetime import datetime

import msgspec

from libs.bus import Bus
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.jobs import ConditionType, Job, JobEvent, JobStatus, Phase, with_condition

log = logging.getLogger("nodus.gangs")
RUNNING_PHASES = (Phase.PLACED, Phase.PROBING, Phase.RUNNING)
NODE_REPAIR = "NodeRepair"  # R16: a repair interrupts the gang
FAULT_BROKE_MEMBER = "FaultBrokeMember"  # R17: a fault took away what a member runs on


def without_members(
    status: JobStatus, nodes: list[str], reason: str, message: str, t: datetime
) -> JobStatus:
    """Back to placement without `nodes`, which it lost: avoided while another machine fits,
    used again when none does once they are healthy and free (`status.lost`)."""
    status = with_condition(status, ConditionType.GANG_READY, "False", reason, message, t)
    return msgspec.structs.replace(
        status,
        phase=Phase.PENDING,
        avoid=[*status.avoid, *nodes],
        lost=[*status.lost, *nodes],
    )


async def restart_gang(
    bus: Bus, node: str, gang: str, epoch: int, reason: str, message: str
) -> bool:
    """`gang` goes back to placement without `node`, if `epoch` is still its current one
    and active; True if this call did it."""
    jobs = bus.bucket(names.BUCKET_JOBS, Job)
    t = now()

    def replace(job: Job | None, t: datetime = t) -> Job | None:
        if job is None or job.status.epoch != epoch:
            return None
        if job.status.phase not in RUNNING_PHASES:
            return None
        status = without_members(job.status, [node], reason, message, t)
        return msgspec.structs.replace(job, status=status)

    try:
        if await jobs.mutate(gang, replace) is None:
            return False
    except Exception as error:  # the job moved on; the placer's member checks remain
        log.warning("could not restart %s for %s: %s", gang, node, error)
        return False
    log.warning("%s: %s", gang, message)
    event = JobEvent(gang=gang, kind=reason, epoch=epoch, message=message, time=t)
    try:
        await bus.publish(names.job_event(gang, reason.lower()), event)
    except Exception as error:  # the job record is the truth; the event is its audit
        log.warning("event %s for %s not published: %s", reason, gang, error)
    return True

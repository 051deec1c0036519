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
from libs.contracts.epochs import Lease
from libs.contracts.jobs import ConditionType, Job, JobEvent, Phase, with_condition

log = logging.getLogger("nodus.gangs")
RUNNING_PHASES = (Phase.PLACED, Phase.PROBING, Phase.RUNNING)
NODE_REPAIR = "NodeRepair"  # R16: a repair interrupts the gang
FAULT_BROKE_MEMBER = "FaultBrokeMember"  # R17: a fault took away what a member runs on


async def restart_gang(bus: Bus, node: str, lease: Lease, reason: str, message: str) -> bool:
    """The gang holding `lease` goes back to placement without `node`, if that epoch is
    still its current one and active; True if this call did it."""
    jobs = bus.bucket(names.BUCKET_JOBS, Job)
    t = now()

    def replace(job: Job | None, t: datetime = t) -> Job | None:
        if job is None or job.status.epoch != lease.epoch:
            return None
        if job.status.phase not in RUNNING_PHASES:
            return None
        status = with_condition(job.status, ConditionType.GANG_READY, "False", reason, message, t)
        status = msgspec.structs.replace(status, phase=Phase.PENDING, avoid=[*status.avoid, node])
        return msgspec.structs.replace(job, status=status)

    try:
        if await jobs.mutate(lease.gang, replace) is None:
            return False
    except Exception as error:  # the job moved on; the placer's member checks remain
        log.warning("could not restart %s for %s: %s", lease.gang, node, error)
        return False
    log.warning("%s: %s", lease.gang, message)
    event = JobEvent(gang=lease.gang, kind=reason, epoch=lease.epoch, message=message, time=t)
    try:
        await bus.publish(names.job_event(lease.gang, reason.lower()), event)
    except Exception as error:  # the job record is the truth; the event is its audit
        log.warning("event %s for %s not published: %s", reason, lease.gang, error)
    return True

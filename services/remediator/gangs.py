"""R16: repairing a node of a running gang restarts the gang in a new epoch
(`libs.gangs.restart_gang`)."""

from __future__ import annotations

from libs.bus import Bus
from libs.contracts.epochs import Lease
from libs.gangs import NODE_REPAIR, restart_gang


async def restart_gangs(bus: Bus, node: str, leases: list[Lease], remediation_id: str) -> None:
    for lease in leases:
        message = (
            f"{node} is being repaired (remediation {remediation_id}); epoch {lease.epoch} ends "
            "and the gang is placed again without it"
        )
        await restart_gang(bus, node, lease, NODE_REPAIR, message)

"""Builders for machines, node records and jobs, shared by unit, integration and bench code."""

from __future__ import annotations

from typing import Any

import msgspec

from libs.bus import Versioned
from libs.contracts import names
from libs.contracts.base import convert, now
from libs.contracts.fleet import Machine, NodeHealth, NodeRecord
from libs.contracts.jobs import GangMember, GangStatus, Job, PathClass, Phase
from services.agent.inventory import capabilities_of, inventory_of


def machine(name: str, **fields: Any) -> Machine:
    """A machine with sensible defaults; any fleet-file field (camelCase) can be overridden."""
    data: dict[str, Any] = {
        "name": name,
        "provider": "aws",
        "region": "us-east-1",
        "regionClass": "us",
        "offering": "vm",
        "address": "10.0.0.1",
        "pool": "pool",
        "cluster": "cluster",
        "accelerators": {"count": 8, "backend": "cuda", "model": "H100"},
    }
    data.update(fields)
    return convert(data, Machine)


def node_record(
    m: Machine, capabilities: list[str] | None = None, namespace: str = "ns-1"
) -> NodeRecord:
    inventory = inventory_of(m)
    inventory.network_namespace = namespace
    return NodeRecord(
        inventory=inventory,
        agent_version="0.1.0",
        capabilities=capabilities if capabilities is not None else capabilities_of(m),
        registered_time=now(),
        boot_id="boot-" + m.name,
        socks_endpoint="127.0.0.1:1080",
    )


def job(name: str = "train", org: str = "acme", **spec: Any) -> Job:
    """A job from keyword spec fields (camelCase), e.g. distributed={"members": 2}."""
    body: dict[str, Any] = {"command": ["python", "train.py"], "distributed": {"members": 2}}
    body.update(spec)
    return convert({"metadata": {"name": name, "org": org}, "spec": body}, Job)


async def register(bus: Any, records: list[NodeRecord]) -> None:
    """What agents do at start: inventory into nodes, a fresh heartbeat into health."""
    import asyncio

    nodes = bus.bucket(names.BUCKET_NODES, NodeRecord)
    health = bus.bucket(names.BUCKET_HEALTH, NodeHealth)
    t = now()
    await asyncio.gather(
        *(nodes.put(r.inventory.node, r) for r in records),
        *(
            health.put(
                r.inventory.node, NodeHealth(node=r.inventory.node, healthy=True, heartbeat_time=t)
            )
            for r in records
        ),
    )


def relayed(
    name: str, phase: Phase, slots: list[int], revision: int, relays: list[str] | None = None
) -> Versioned[Job]:
    """Job `name` in `phase`, a Relayed gang whose members home on `slots` (of `relays`)."""
    base = job(name)
    members = [
        GangMember(rank=i, node=f"{name}-{i}", address="", relay_slot=s)
        for i, s in enumerate(slots)
    ]
    status = msgspec.structs.replace(
        base.status,
        phase=phase,
        epoch=1,
        gang=GangStatus(PathClass.RELAYED, members, relays=relays or []),
    )
    return Versioned(base.key, msgspec.structs.replace(base, status=status), revision)

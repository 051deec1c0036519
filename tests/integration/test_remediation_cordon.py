"""The placer never places a gang on a cordoned node (a repair under way, a person's
maintenance, a retired machine), and places again once the last hold is lifted."""

from __future__ import annotations

from datetime import UTC, datetime

from libs.bus import Bus
from libs.client.client import Client
from libs.contracts import names
from libs.contracts.jobs import ConditionType, Job, Phase
from libs.contracts.remediation import Cordon, CordonHold
from services.placer.cluster import ClusterView, cordoned
from tests.conftest import StartPlacer, eventually
from tests.factories import job, machine, node_record, register

T0 = datetime(2025, 1, 1, tzinfo=UTC)


def hold(by: str) -> CordonHold:
    return CordonHold(by=by, reason="test", time=T0)


def test_a_node_with_any_hold_is_not_free() -> None:
    from libs.contracts.fleet import NodeHealth

    view = ClusterView(heartbeat_timeout=60)
    record = node_record(machine("gpu-a"))
    view.set_record("gpu-a", record, T0)
    view.set_health("gpu-a", NodeHealth(node="gpu-a", healthy=True, heartbeat_time=T0), T0)
    assert "gpu-a" in view.free
    view.cordons["gpu-a"] = Cordon(node="gpu-a", holds={"remediator": hold("remediator")})
    assert view.refresh("gpu-a", T0) and "gpu-a" not in view.free
    view.cordons["gpu-a"] = Cordon(node="gpu-a", holds={})
    assert view.refresh("gpu-a", T0) and "gpu-a" in view.free
    assert not cordoned(view.cordons, "gpu-a") and not cordoned({}, "gpu-b")


async def test_the_placer_skips_cordoned_nodes(bus: Bus, start_placer: StartPlacer) -> None:
    await register(
        bus,
        [
            node_record(machine(n, address=f"10.0.0.{i + 1}"))
            for i, n in enumerate(["gpu-a", "gpu-b", "gpu-c"])
        ],
    )
    cordons = bus.bucket(names.BUCKET_CORDONS, Cordon)
    await cordons.put("gpu-b", Cordon(node="gpu-b", holds={"bob": hold("bob")}))
    await cordons.put("gpu-c", Cordon(node="gpu-c", holds={"remediator": hold("remediator")}))
    await start_placer()
    wanted = job("train", "acme", distributed={"members": 2})
    await Client(bus).apply(wanted)
    jobs = bus.bucket(names.BUCKET_JOBS, Job)

    async def unschedulable() -> bool:
        current = await jobs.get(wanted.key)
        ready = current.value.condition(ConditionType.GANG_READY) if current else None
        return ready is not None and ready.reason == "Unschedulable"

    await eventually(unschedulable)
    # the remediator's repair ends: its hold goes, the node is free again
    await cordons.put("gpu-c", Cordon(node="gpu-c", holds={}))

    async def placed() -> bool:
        current = await jobs.get(wanted.key)
        return current is not None and current.value.status.phase is Phase.PLACED

    await eventually(placed)
    current = await jobs.get(wanted.key)
    assert current is not None and current.value.status.gang is not None
    assert {m.node for m in current.value.status.gang.members} == {"gpu-a", "gpu-c"}

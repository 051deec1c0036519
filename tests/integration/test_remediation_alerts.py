"""Signals to alerts to recommendations on a real nats-server (R1-R4, R13 persistence, S1,
S3): faults written in their real formats into each machine's files, the monitor scanning
them, the remediator turning them into alerts with evidence, then recommendations."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from libs.contracts import names
from libs.contracts.base import decode, now
from libs.contracts.remediation import (
    Action,
    Alert,
    AlertKind,
    Policy,
    RemediationState,
)
from tests.integration.remediation_fixtures import (
    fleet_fixture,  # noqa: F401  (the `fleet` fixture)
)
from tests.remediation_support import Fleet

# -- S1, S3: signals that name another node, malformed records -----------------------------------


async def test_forged_and_malformed_signals_are_dropped(fleet: Fleet) -> None:
    from libs.contracts.remediation import SignalReport
    from services.remediator import metrics

    await fleet.add_machines(["gpu-a", "gpu-b"], pool="h100", cluster="c1")
    remediator = await fleet.start_remediator()
    before = _count(metrics.SIGNALS_DROPPED.labels("wrong_node"))
    forged = SignalReport(node="gpu-b", source="npd", observed_time=now(), findings=[])
    signals = fleet.bus.bucket(names.BUCKET_SIGNALS, SignalReport)
    await signals.put("gpu-a.npd", forged)  # gpu-a's key, gpu-b's name: refused (S1)
    kv = await fleet.bus.js.key_value(names.BUCKET_SIGNALS)
    await kv.put("gpu-a.kmsg", b"\x00not json{")  # S3: skipped and counted, never fatal

    async def dropped() -> bool:
        return _count(metrics.SIGNALS_DROPPED.labels("wrong_node")) > before

    await fleet.until(dropped, scan=False)
    # the remediator still works
    fleet.inject("gpu-a", "readonly-fs")

    async def fired() -> bool:
        return any(a.node == "gpu-a" for a in (await fleet.alerts()).values())

    await fleet.until(fired)
    assert not any(a.node == "gpu-b" for a in (await fleet.alerts()).values())
    assert remediator.replica == "r1"


# -- R1, R2, R3, R4, R5 (default), R13 persistence ---------------------------------------------


async def test_an_xid_becomes_an_alert_with_evidence_then_a_recommendation(fleet: Fleet) -> None:
    await fleet.add_machines(["gpu-a", "gpu-b"], pool="h100", cluster="c1")
    await fleet.start_remediator()
    written = fleet.inject("gpu-a", "xid", xid=79, gpu=2)
    alert_id = "gpu-a.xid-79.0000-3a-00"

    async def alert_fired() -> bool:
        return alert_id in await fleet.alerts()

    events = await fleet.bus.js.subscribe("nodus.evt.alert.>", ordered_consumer=True)
    await fleet.until(alert_fired)
    alert = (await fleet.alerts())[alert_id]
    assert alert.summary == "Xid 79 (GPU has fallen off the bus) on GPU 0000:3a:00 on gpu-a"
    assert "power cycled" in alert.description
    assert (alert.cluster, alert.pool, alert.severity) == ("c1", "h100", "critical")
    [evidence] = alert.evidence
    assert evidence.source == "kmsg" and evidence.where.endswith("machines/gpu-a/kmsg")
    assert evidence.lines == [written.split(": ", 1)[1]]
    assert evidence.labels["pci"] == "0000:3a:00" and evidence.xid == 79
    # the notification carries the same record as the API and the CLI
    message = await events.next_msg(timeout=5)
    assert decode(message.data, Alert).summary == alert.summary
    # not persisted for its window yet: no recommendation
    assert await fleet.recommendations() == {}
    fleet.clock.advance(seconds=61)

    async def recommended() -> bool:
        return alert_id in await fleet.recommendations()

    await fleet.until(recommended)
    rec = (await fleet.recommendations())[alert_id]
    assert rec.action is Action.POWER_CYCLE and "Xid 79 -> PowerCycle" in rec.rule
    # default policy: a person approves; nothing is repaired meanwhile
    pending = await fleet.remediation_in("gpu-a", RemediationState.PENDING)
    assert pending.requester.kind == "automatic" and pending.approver is None
    assert pending.evidence == alert.evidence
    assert "ApproveBeforeRepair" in pending.reason
    assert fleet.executed == []


async def test_each_detector_fires_its_alert(fleet: Fleet) -> None:
    await fleet.add_machines(["gpu-a"], pool="h100", cluster="c1")
    await fleet.start_remediator()
    injected: list[tuple[str, dict[str, Any]]] = [
        ("gpu-off-bus", {"gpu": 1}),
        ("ecc-dbe", {"gpu": 0}),
        ("row-remap-failure", {"gpu": 1}),
        ("thermal", {"gpu": 0}),
        ("readonly-fs", {}),
        ("ib-down", {"port": "mlx5_0/1"}),
        ("unreachable", {}),
    ]
    for kind, options in injected:
        fleet.inject("gpu-a", kind, **options)
    expected = {
        AlertKind.GPU_OFF_BUS,
        AlertKind.ECC_DOUBLE_BIT,
        AlertKind.ROW_REMAP_FAILURE,
        AlertKind.THERMAL_THROTTLING,
        AlertKind.READONLY_FILESYSTEM,
        AlertKind.INFINIBAND_PORT_DOWN,
        AlertKind.HOST_UNREACHABLE,
    }

    async def all_fired() -> bool:
        return expected <= {a.kind for a in (await fleet.alerts()).values()}

    await fleet.until(all_fired)
    for alert in (await fleet.alerts()).values():
        assert alert.summary and alert.description and alert.evidence
        assert alert.evidence[0].lines or alert.evidence[0].values


async def test_not_ready_alone_never_repairs(fleet: Fleet) -> None:
    await fleet.add_machines(["gpu-a"], pool="h100", cluster="c1")
    assert fleet.monitor is not None
    fleet.monitor.heartbeat_timeout = timedelta(seconds=0.5)
    fleet.monitor.reachability = False
    await fleet.set_policy(Policy(mode="Automatic", trusted_actions=list(Action)))
    await fleet.start_remediator()
    await fleet.agents["gpu-a"].stop()  # heartbeats stop: NotReady
    fleet.monitor._started -= timedelta(seconds=5)

    async def not_ready() -> bool:
        return any(a.kind is AlertKind.NODE_NOT_READY for a in (await fleet.alerts()).values())

    await fleet.until(not_ready, timeout=15)
    fleet.clock.advance(hours=5)
    await fleet.scan()
    assert await fleet.recommendations() == {}
    assert await fleet.remediations() == []
    await fleet.agents["gpu-a"].start()


def _count(counter: Any) -> float:
    return float(counter._value.get())

"""The remediator's asyncio shell: the store's watches keep a view of signals, alerts,
recommendations, remediations, policy, guardrails, nodes, heartbeats and leases; a reconcile loop
per node converges them with the decisions of the sans-I/O modules; the API takes approvals,
cancellations, external requests and breaker resets.

Every write is a compare-and-set on a KV revision and every id is derived from what it is
about, so replicas that race write one outcome and a replica that restarts resumes where the
records say it stood (R14).

The rooms: `store` (buckets, views, writes, events), `libs.runtime.workqueue` (which node is
reconciled next), `alerting` (signals to alerts to recommendations), `intake` (recommendations to
remediations), `repairs` (each remediation through its states), `cordons`, `slots` and
`breakers` (the guardrails on the bus), `api` (the request/reply endpoints). This wires them."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from datetime import datetime

from libs.bus import Bus, CallerEndpoint, Endpoint
from libs.contracts import names
from libs.contracts.base import now as utc_now
from libs.contracts.remediation import (
    Action,
    AlertState,
    ApproveRequest,
    BreakerResetRequest,
    CancelRequest,
    LabelRequest,
    PersonRepairRequest,
    RemediationState,
    RepairRequest,
)
from libs.jobs.store import publish_recent_events
from libs.runtime.tasks import TaskSet
from libs.runtime.version import VERSION
from libs.runtime.workqueue import WorkQueue
from services.remediator import guardrails, metrics
from services.remediator.alerting import Alerting
from services.remediator.alerts import AlertSettings
from services.remediator.api import Api
from services.remediator.breakers import Breakers
from services.remediator.cordons import Cordons
from services.remediator.intake import Intake
from services.remediator.lifecycle import remediation_id
from services.remediator.provider import MachineProvider
from services.remediator.repairs import Repairs
from services.remediator.slots import Slots
from services.remediator.store import Store

log = logging.getLogger("nodus.remediator")


class Remediator:
    def __init__(
        self,
        bus: Bus,
        provider: MachineProvider,
        settings: guardrails.Settings | None = None,
        replica: str | None = None,
        clock: Callable[[], datetime] = utc_now,
        alert_settings: AlertSettings | None = None,
        tick_seconds: float = 1.0,
        workers: int = 32,
    ) -> None:
        self.bus = bus
        self.provider = provider
        self.settings = settings or guardrails.Settings()
        self.alert_settings = alert_settings or AlertSettings()
        self.replica = replica or f"remediator-{secrets.token_hex(3)}"
        self.clock = clock
        self.tick_seconds = tick_seconds
        self.queue = WorkQueue(self.reconcile, workers, log)
        self.store = Store(bus, self.queue.mark)
        self.slots = Slots(self.store, self.settings)
        self.breakers = Breakers(self.store, self.settings)
        self.cordons = Cordons(self.store)
        self.alerting = Alerting(self.store, self.settings, self.alert_settings, clock)
        self.intake = Intake(self.store, self.slots, self.breakers, self.cordons, self.replica)
        self.repairs = Repairs(
            self.store,
            self.slots,
            self.breakers,
            self.cordons,
            provider,
            self.settings,
            self.replica,
            clock,
        )
        self.api = Api(self.store, self.slots, self.breakers, provider, self.settings, clock)
        self._tasks = TaskSet("remediator", log)  # the ticker

    # -- start and stop ------------------------------------------------------------------------

    async def start(self) -> None:
        await self.store.start()
        self.queue.start()
        self._tasks.spawn(self._ticker(), name="ticker")
        self._tasks.spawn(publish_recent_events(self.bus), name="recent events")
        for node in set(self.store.alerts_of) | set(self.store.rems_of):
            self.queue.mark(node)
        await self.bus.serve(
            "nodus-remediator",
            VERSION,
            "Detects faults, decides, approves, repairs and revalidates nodes",
            [
                Endpoint(
                    "approve", names.API_REMEDIATION_APPROVE, ApproveRequest, self.api.approve
                ),
                Endpoint("cancel", names.API_REMEDIATION_CANCEL, CancelRequest, self.api.cancel),
                Endpoint(
                    "request",
                    names.API_REMEDIATION_REQUEST,
                    PersonRepairRequest,
                    self.api.request_by_person,
                ),
                CallerEndpoint(
                    "external",
                    names.API_REMEDIATION_EXTERNAL,
                    RepairRequest,
                    self.api.request_repair,
                    concurrency=16,
                ),
                CallerEndpoint(
                    "label", names.API_NODE_LABEL, LabelRequest, self.api.label_node, concurrency=16
                ),
                Endpoint(
                    "breaker-reset",
                    names.API_REMEDIATION_BREAKER_RESET,
                    BreakerResetRequest,
                    self.api.reset_breaker,
                ),
            ],
            queue_group="nodus-remediator",
        )
        log.info(
            "remediator %s ready: %d nodes, %d alerts, %d remediations",
            self.replica,
            len(self.store.nodes),
            len(self.store.alerts),
            len(self.store.rems),
        )

    async def stop(self) -> None:
        await self._tasks.close()
        await self.queue.stop()
        await self.store.stop()

    async def settled(self, timeout: float = 10.0) -> None:
        """Wait until no node waits to be reconciled (tests and benchmarks)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.queue.idle and not self.store.reports:
                return
            await asyncio.sleep(0.01)

    # -- the reconcile loop --------------------------------------------------------------------

    async def reconcile(self, node: str) -> None:
        for report, received in self.store.take_reports(node):
            await self.alerting.apply_report(report, received)
        now = self.clock()
        await self.alerting.recommend(node, now)
        await self.intake.create(node, now)
        for rid in sorted(self.store.rems_of.get(node, set())):
            current = self.store.rems.get(rid)
            if current is None:
                continue
            if current.value.active:
                await self.repairs.advance(rid, now)
            current = self.store.rems.get(rid)
            if current is not None and not current.value.active and not current.value.settled:
                await self.repairs.settle(rid, now)
        await self.cordons.lift_if_healthy(node)

    async def _ticker(self) -> None:
        """Time moves decisions too: persistence windows, idle deadlines, cooldowns, timeouts.
        Only what waits on time is looked at again; everything else moves on events."""
        while True:
            await asyncio.sleep(self.tick_seconds)
            for node in self._waiting_on_time():
                self.queue.mark(node)
            self._gauges()

    def _waiting_on_time(self) -> set[str]:
        store = self.store
        nodes: set[str] = set()
        for alert in store.alerts.values():
            a = alert.value
            if (
                a.state is AlertState.FIRING
                and a.action is not Action.NONE
                and (a.id not in store.recs or store.recs[a.id].value.generation != a.generation)
            ):
                nodes.add(a.node)
        for rec in store.recs.values():
            r = rec.value
            if r.remediation_id != remediation_id(r.node, r.alert_id, r.generation):
                nodes.add(r.node)
        for rem in store.rems.values():
            m = rem.value
            if (m.active and m.state is not RemediationState.PENDING) or not m.settled:
                nodes.add(m.node)
        return nodes

    def _gauges(self) -> None:
        metrics.ALERTS_FIRING.set(
            sum(1 for a in self.store.alerts.values() if a.value.state is AlertState.FIRING)
        )
        metrics.RECOMMENDATIONS.set(len(self.store.recs))
        counts: dict[str, int] = {state.value: 0 for state in RemediationState}
        for rem in self.store.rems.values():
            if rem.value.active:
                counts[rem.value.state.value] += 1
        for state, count in counts.items():
            metrics.ACTIVE.labels(state).set(count)

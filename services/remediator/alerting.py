"""Signals to alerts (R1, R2) and alerts to recommendations (R4, R10, R11, R13) on the bus: the
rules are the sans-I/O `alerts` and `decide`; this writes what they decide, with
compare-and-set, and tells what fired."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import datetime
from typing import Any

from libs.contracts import names
from libs.contracts.remediation import Alert, AlertState, SignalReport
from libs.faults.catalog import breaks_workload_rule
from libs.jobs.lifecycle import FAULT_BROKE_MEMBER
from libs.jobs.store import restart_gang
from services.remediator import alerts as alert_rules
from services.remediator import decide, guardrails, ladder, metrics
from services.remediator.alerts import AlertSettings, Placement
from services.remediator.store import Store


class Alerting:
    def __init__(
        self,
        store: Store,
        settings: guardrails.Settings,
        alert_settings: AlertSettings,
        clock: Callable[[], datetime],
    ) -> None:
        self.store = store
        self.settings = settings
        self.alert_settings = alert_settings
        self.clock = clock
        self._reported_at: dict[str, float] = {}  # alert id: when the report that fired it came

    async def apply_report(self, report: SignalReport, received: float) -> None:
        metrics.SIGNALS.labels(report.source).inc()
        now = self.clock()
        record = self.store.nodes.get(report.node)
        where = Placement(
            record.value.inventory.cluster if record else "",
            record.value.inventory.pool if record else "",
        )
        firing = self.store.firing_of(report.node)
        for aid, finding in alert_rules.report_changes(report, firing):

            def change(current: Alert | None, finding: Any = finding) -> Alert | None:
                return alert_rules.next_alert(
                    current, finding, report, where, now, self.alert_settings
                )

            before = self.store.alerts.get(aid)
            written = await self.store.mutate(
                self.store.alert_bucket, self.store.alerts, aid, change
            )
            if written is None:
                continue
            self.store.alerts_of.setdefault(report.node, set()).add(aid)
            self._reported_at[aid] = received
            was = before.value.state if before else None
            if written.value.state is not was:
                metrics.ALERTS.labels(written.value.kind.value, written.value.state.value).inc()
                self.store.event(
                    names.alert_event(report.node, alert_rules.kind_token(written.value.kind)),
                    written.value,
                    f"{aid}.{written.revision}",
                )
                if written.value.state is AlertState.FIRING and written.value.breaks_workload:
                    await self._member_lost(written.value)

    async def _member_lost(self, alert: Alert) -> None:
        """R17: the fault took away what the member's ranks run on. The gang on the node does
        not wait for the persistence window or a repair: its epoch ends now, and it is placed
        again without the node (the repair later finds the node idle)."""
        held = self.store.leases.get(alert.node)
        if held is None:
            return
        message = (
            f"{alert.node}: {breaks_workload_rule(alert.summary)}; epoch {held.value.epoch} "
            f"ends (alert {alert.id})"
        )
        lease = held.value
        if await restart_gang(
            self.store.bus, alert.node, lease.gang, lease.epoch, FAULT_BROKE_MEMBER, message
        ):
            metrics.MEMBERS_LOST.inc()

    async def recommend(self, node: str, now: datetime) -> None:
        store = self.store
        for aid in sorted(store.alerts_of.get(node, set())):
            alert = store.alerts.get(aid)
            current = store.recs.get(aid)
            if alert is None:
                desired = None
            else:
                key = ladder.ladder_key(
                    node, alert.value.cluster, alert.value.kind, alert.value.xid
                )
                lad = store.ladders.get(key)
                desired = decide.recommend(
                    alert.value,
                    lad.value if lad else None,
                    now,
                    self.settings,
                    current.value if current else None,
                )
            if desired is None:
                if current is not None and await store.rec_bucket.delete(aid, current.revision):
                    store.recs.pop(aid, None)
                continue
            if current is not None and desired is current.value:
                continue
            if current is None:
                revision = await store.rec_bucket.create(aid, desired)
            else:
                revision = await store.rec_bucket.update(aid, desired, current.revision)
            if revision is None:
                metrics.CONFLICTS.labels("recommendation").inc()
                continue
            store.recs.apply(aid, desired, revision)
            started = self._reported_at.pop(aid, None)
            if started is not None and current is None:
                metrics.DECISION_SECONDS.observe(time.perf_counter() - started)

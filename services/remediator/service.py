"""The remediator's asyncio shell: KV watches keep a view of signals, alerts, recommendations,
remediations, policy, guardrails, nodes, heartbeats and leases; a reconcile loop per node
converges them with the decisions of the sans-I/O modules; the API takes approvals,
cancellations, external requests and breaker resets.

Every write is a compare-and-set on a KV revision and every id is derived from what it is
about, so replicas that race write one outcome and a replica that restarts resumes where the
records say it stood (R14)."""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

import msgspec

from libs.bus import Bus, Endpoint, Versioned
from libs.bus.kv import Bucket
from libs.contracts import names
from libs.contracts.base import now as utc_now
from libs.contracts.epochs import Lease
from libs.contracts.fleet import NodeHealth, NodeRecord
from libs.contracts.remediation import (
    Action,
    Alert,
    AlertState,
    Approver,
    ApproveRequest,
    Breaker,
    BreakerResetRequest,
    CancelRequest,
    Cordon,
    CordonHold,
    Ladder,
    LadderAttempt,
    Outcome,
    Policy,
    Recommendation,
    Remediation,
    RemediationState,
    RepairRequest,
    RepairSlots,
    Requester,
    SignalReport,
    Transition,
)
from libs.runtime.tasks import cancel_and_wait
from libs.runtime.version import VERSION
from services.remediator import alerts as alert_rules
from services.remediator import guardrails, ladder, lifecycle, metrics, policy
from services.remediator.alerts import AlertSettings, Placement
from services.remediator.api import Api
from services.remediator.decide import effective_action, has_failed_check, recommend
from services.remediator.gangs import restart_gangs
from services.remediator.lifecycle import remediation_id
from services.remediator.provider import MachineProvider

log = logging.getLogger("nodus.remediator")
REMEDIATOR_HOLD = "remediator"  # the remediator's cordon hold; it never lifts anyone else's
RETIRED_HOLD = "retired"

S = TypeVar("S", bound=msgspec.Struct)


class _View(dict[str, Versioned[S]]):
    """A KV bucket's records as the watch delivered them; our own writes go in at once.
    An older revision never replaces a newer one."""

    def apply(self, key: str, value: S | None, revision: int) -> bool:
        current = self.get(key)
        if current is not None and current.revision > revision:
            return False
        if value is None:
            self.pop(key, None)
        else:
            self[key] = Versioned(key, value, revision)
        return True


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
        heartbeat_timeout_seconds: float = 15.0,
    ) -> None:
        self.bus = bus
        self.provider = provider
        self.settings = settings or guardrails.Settings()
        self.alert_settings = alert_settings or AlertSettings()
        self.replica = replica or f"remediator-{secrets.token_hex(3)}"
        self.clock = clock
        self.tick_seconds = tick_seconds
        self.heartbeat_timeout = heartbeat_timeout_seconds
        self.signals = bus.bucket(names.BUCKET_SIGNALS, SignalReport)
        self.alert_bucket = bus.bucket(names.BUCKET_ALERTS, Alert)
        self.rec_bucket = bus.bucket(names.BUCKET_RECOMMENDATIONS, Recommendation)
        self.rem_bucket = bus.bucket(names.BUCKET_REMEDIATIONS, Remediation)
        self.policy_bucket = bus.bucket(names.BUCKET_REMEDIATION_POLICY, Policy)
        self.ladder_bucket = bus.bucket(names.BUCKET_LADDERS, Ladder)
        self.breaker_bucket = bus.bucket(names.BUCKET_BREAKERS, Breaker)
        self.cordon_bucket = bus.bucket(names.BUCKET_CORDONS, Cordon)
        self.slot_bucket = bus.bucket(names.BUCKET_REPAIR_SLOTS, RepairSlots)
        self.node_bucket = bus.bucket(names.BUCKET_NODES, NodeRecord)
        self.health_bucket = bus.bucket(names.BUCKET_HEALTH, NodeHealth)
        self.lease_bucket = bus.bucket(names.BUCKET_LEASES, Lease)
        self.alerts: _View[Alert] = _View()
        self.recs: _View[Recommendation] = _View()
        self.rems: _View[Remediation] = _View()
        self.policies: _View[Policy] = _View()
        self.ladders: _View[Ladder] = _View()
        self.breakers: _View[Breaker] = _View()
        self.cordons: _View[Cordon] = _View()
        self.nodes: _View[NodeRecord] = _View()
        self.health: _View[NodeHealth] = _View()
        self.leases: _View[Lease] = _View()
        self._alerts_of: dict[str, set[str]] = {}
        self._rems_of: dict[str, set[str]] = {}
        self._clusters: dict[str, set[str]] = {}
        self._slots: _View[RepairSlots] = _View()  # our own writes only; checked by CAS
        self._live = _Live(self.rems, starting=False)
        self._live_starting = _Live(self.rems, starting=True)
        self._reports: dict[str, dict[str, tuple[SignalReport, float]]] = {}
        self._last_report: dict[str, datetime] = {}
        self._reported_at: dict[str, float] = {}
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._queued: set[str] = set()
        self._running: set[str] = set()
        self._rerun: set[str] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._tasks: list[asyncio.Task[None]] = []
        self._background: set[asyncio.Task[None]] = set()
        self._workers = workers
        self.api = Api(self)

    # -- start and stop ------------------------------------------------------------------------

    async def start(self) -> None:
        watched: list[tuple[Bucket[Any], _View[Any], Callable[[str, Any], None] | None]] = [
            (self.node_bucket, self.nodes, self._on_node),
            (self.health_bucket, self.health, self._on_health),
            (self.lease_bucket, self.leases, self._on_lease),
            (self.alert_bucket, self.alerts, self._on_alert),
            (self.rec_bucket, self.recs, self._on_rec),
            (self.rem_bucket, self.rems, self._on_rem),
            (self.policy_bucket, self.policies, self._on_policy),
            (self.ladder_bucket, self.ladders, None),
            (self.breaker_bucket, self.breakers, self._on_breaker),
            (self.cordon_bucket, self.cordons, None),
        ]
        caught_up = [asyncio.Event() for _ in watched]
        self._tasks = [
            asyncio.create_task(self._watch(bucket, view, hook, event))
            for (bucket, view, hook), event in zip(watched, caught_up, strict=True)
        ]
        await asyncio.gather(*(event.wait() for event in caught_up))
        signals_caught_up = asyncio.Event()
        self._tasks.append(asyncio.create_task(self._watch_signals(signals_caught_up)))
        await signals_caught_up.wait()
        self._tasks += [asyncio.create_task(self._worker()) for _ in range(self._workers)]
        self._tasks.append(asyncio.create_task(self._ticker()))
        for node in set(self._alerts_of) | set(self._rems_of):
            self.mark(node)
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
                    RepairRequest,
                    self.api.request_repair,
                    concurrency=16,
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
            len(self.nodes),
            len(self.alerts),
            len(self.rems),
        )

    async def stop(self) -> None:
        await cancel_and_wait([*self._tasks, *self._background])

    async def settled(self, timeout: float = 10.0) -> None:
        """Wait until no node waits to be reconciled (tests and benchmarks)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self._queued and not self._running and not self._reports:
                return
            await asyncio.sleep(0.01)

    # -- watches -------------------------------------------------------------------------------

    async def _watch(
        self,
        bucket: Bucket[Any],
        view: _View[Any],
        hook: Callable[[str, Any], None] | None,
        caught_up: asyncio.Event,
    ) -> None:
        async for change in bucket.watch(caught_up=caught_up):
            if view.apply(change.key, change.value, change.revision) and hook is not None:
                hook(change.key, change.value)

    def _on_node(self, key: str, record: NodeRecord | None) -> None:
        for members in self._clusters.values():
            members.discard(key)
        if record is not None:
            self._clusters.setdefault(record.inventory.cluster, set()).add(key)

    def _on_health(self, key: str, _: object) -> None:
        if self._active_of(key):
            self.mark(key)

    def _on_lease(self, key: str, _: object) -> None:
        if self._active_of(key):
            self.mark(key)

    def _on_alert(self, key: str, alert: Alert | None) -> None:
        node = key.split(".", 1)[0]
        if alert is None:
            self._alerts_of.get(node, set()).discard(key)
        else:
            self._alerts_of.setdefault(alert.node, set()).add(key)
        self.mark(node)

    def _on_rec(self, key: str, _: object) -> None:
        self.mark(key.split(".", 1)[0])

    def _on_rem(self, key: str, rem: Remediation | None) -> None:
        node = key.split(".", 1)[0]
        if rem is not None:
            self._rems_of.setdefault(rem.node, set()).add(key)
        self.mark(node)

    def _on_policy(self, _: str, __: object) -> None:
        for node in list(self._alerts_of):
            self.mark(node)

    def _on_breaker(self, key: str, breaker: Breaker | None) -> None:
        metrics.BREAKER_OPEN.labels(key).set(1 if breaker is not None and breaker.open else 0)
        for node in self._clusters.get(key, set()):
            if self._rems_of.get(node):
                self.mark(node)

    async def _watch_signals(self, caught_up: asyncio.Event) -> None:
        async for change in self.signals.watch(caught_up=caught_up):
            report = change.value
            if report is None:
                continue
            if change.key != names.signal_key(report.node, report.source):
                metrics.SIGNALS_DROPPED.labels("wrong_node").inc()
                log.warning("dropped a report for %s under key %s (S1)", report.node, change.key)
                continue
            last = self._last_report.get(change.key)
            if last is not None and report.observed_time < last:
                metrics.SIGNALS_DROPPED.labels("stale").inc()
                continue
            self._last_report[change.key] = report.observed_time
            received = time.perf_counter()
            self._reports.setdefault(report.node, {})[report.source] = (report, received)
            self.mark(report.node)

    # -- the reconcile loop --------------------------------------------------------------------

    def mark(self, node: str) -> None:
        if node in self._running:
            self._rerun.add(node)
        elif node not in self._queued:
            self._queued.add(node)
            self._queue.put_nowait(node)

    async def _ticker(self) -> None:
        """Time moves decisions too: persistence windows, idle deadlines, cooldowns, timeouts.
        Only what waits on time is looked at again; everything else moves on events."""
        while True:
            await asyncio.sleep(self.tick_seconds)
            for node in self._waiting_on_time():
                self.mark(node)
            self._gauges()

    def _waiting_on_time(self) -> set[str]:
        nodes: set[str] = set()
        for alert in self.alerts.values():
            a = alert.value
            if (
                a.state is AlertState.FIRING
                and a.action is not Action.NONE
                and (a.id not in self.recs or self.recs[a.id].value.generation != a.generation)
            ):
                nodes.add(a.node)
        for rec in self.recs.values():
            r = rec.value
            if r.remediation_id != remediation_id(r.node, r.alert_id, r.generation):
                nodes.add(r.node)
        for rem in self.rems.values():
            m = rem.value
            if (m.active and m.state is not RemediationState.PENDING) or not m.settled:
                nodes.add(m.node)
        return nodes

    def _gauges(self) -> None:
        metrics.ALERTS_FIRING.set(
            sum(1 for a in self.alerts.values() if a.value.state is AlertState.FIRING)
        )
        metrics.RECOMMENDATIONS.set(len(self.recs))
        counts: dict[str, int] = {state.value: 0 for state in RemediationState}
        for rem in self.rems.values():
            if rem.value.active:
                counts[rem.value.state.value] += 1
        for state, count in counts.items():
            metrics.ACTIVE.labels(state).set(count)

    async def _worker(self) -> None:
        while True:
            node = await self._queue.get()
            self._queued.discard(node)
            self._running.add(node)
            try:
                await self.reconcile(node)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reconciling %s failed; the next tick tries again", node)
            finally:
                self._running.discard(node)
                if node in self._rerun:
                    self._rerun.discard(node)
                    self.mark(node)

    async def reconcile(self, node: str) -> None:
        for report, received in self._reports.pop(node, {}).values():
            await self._apply_report(report, received)
        now = self.clock()
        await self._recommend(node, now)
        await self._create(node, now)
        for rid in sorted(self._rems_of.get(node, set())):
            current = self.rems.get(rid)
            if current is None:
                continue
            if current.value.active:
                await self._advance(rid, now)
            current = self.rems.get(rid)
            if current is not None and not current.value.active and not current.value.settled:
                await self._settle(rid, now)
        await self._lift_cordon_if_healthy(node)

    # -- signals to alerts (R1, R2) ------------------------------------------------------------

    async def _apply_report(self, report: SignalReport, received: float) -> None:
        metrics.SIGNALS.labels(report.source).inc()
        now = self.clock()
        record = self.nodes.get(report.node)
        where = Placement(
            record.value.inventory.cluster if record else "",
            record.value.inventory.pool if record else "",
        )
        firing = [
            a.value
            for i in self._alerts_of.get(report.node, set())
            if (a := self.alerts.get(i)) is not None and a.value.state is AlertState.FIRING
        ]
        for aid, finding in alert_rules.report_changes(report, firing):

            def change(current: Alert | None, finding: Any = finding) -> Alert | None:
                return alert_rules.next_alert(
                    current, finding, report, where, now, self.alert_settings
                )

            before = self.alerts.get(aid)
            written = await self._mutate(self.alert_bucket, self.alerts, aid, change)
            if written is None:
                continue
            self._alerts_of.setdefault(report.node, set()).add(aid)
            self._reported_at[aid] = received
            was = before.value.state if before else None
            if written.value.state is not was:
                metrics.ALERTS.labels(written.value.kind.value, written.value.state.value).inc()
                self._event(
                    names.alert_event(report.node, alert_rules.kind_token(written.value.kind)),
                    written.value,
                    f"{aid}.{written.revision}",
                )

    # -- alerts to recommendations (R4, R10, R11, R13) -----------------------------------------

    async def _recommend(self, node: str, now: datetime) -> None:
        for aid in sorted(self._alerts_of.get(node, set())):
            alert = self.alerts.get(aid)
            current = self.recs.get(aid)
            if alert is None:
                desired = None
            else:
                key = ladder.ladder_key(
                    node, alert.value.cluster, alert.value.kind, alert.value.xid
                )
                lad = self.ladders.get(key)
                desired = recommend(
                    alert.value,
                    lad.value if lad else None,
                    now,
                    self.settings,
                    current.value if current else None,
                )
            if desired is None:
                if current is not None and await self.rec_bucket.delete(aid, current.revision):
                    self.recs.pop(aid, None)
                continue
            if current is not None and desired is current.value:
                continue
            if current is None:
                revision = await self.rec_bucket.create(aid, desired)
            else:
                revision = await self.rec_bucket.update(aid, desired, current.revision)
            if revision is None:
                metrics.CONFLICTS.labels("recommendation").inc()
                continue
            self.recs.apply(aid, desired, revision)
            started = self._reported_at.pop(aid, None)
            if started is not None and current is None:
                metrics.DECISION_SECONDS.observe(time.perf_counter() - started)

    # -- recommendations to remediations (R3, R5, R7, R13) -------------------------------------

    def _active_of(self, node: str) -> list[Remediation]:
        return [
            r.value
            for i in self._rems_of.get(node, set())
            if (r := self.rems.get(i)) is not None and r.value.active
        ]

    def _cluster_size(self, cluster: str) -> int:
        return len(self._clusters.get(cluster, set()))

    async def _create(self, node: str, now: datetime) -> None:
        record = self.nodes.get(node)
        if record is None:
            return  # an unknown node cannot be placed in a cluster or pool: wait for it
        cordon = self.cordons.get(node)
        if cordon is not None and RETIRED_HOLD in cordon.value.holds:
            return  # retired (deleted): nothing more to repair here
        active = self._active_of(node)
        candidates = sorted(
            (
                found.value
                for aid in self._alerts_of.get(node, set())
                if (found := self.recs.get(aid)) is not None
            ),
            key=lambda r: (-ladder.RUNG.get(r.action, 0), r.severity != "critical", r.id),
        )
        for rec in candidates:
            rid = remediation_id(node, rec.alert_id, rec.generation)
            if rid in self.rems:
                if rec.remediation_id != rid:  # created by a replica that stopped before this
                    await self._mutate(
                        self.rec_bucket, self.recs, rec.id, _link(rid, rec.generation)
                    )
                continue
            if any(r.id != rid for r in active):
                return  # one repair at a time per node; this one waits its turn
            if not has_failed_check(rec.evidence):
                continue  # R3
            inventory = record.value.inventory
            cluster, pool = inventory.cluster, inventory.pool
            action, r11 = effective_action(rec.action, rec.evidence)
            decided = policy.approval(
                policy.effective(self._policies(), cluster), node, rec.action, rec.xid
            )
            rule = rec.rule
            approver = None
            state = RemediationState.PENDING
            reason = f"waiting for a person's approval ({decided.rule})"
            if decided.automatic:
                admitted = await self._breaker_admit(cluster, rid, now)
                if admitted:
                    approver = Approver(kind="policy", name="policy", rule=decided.rule)
                    state = RemediationState.APPROVED
                    reason = f"approved by policy: {decided.rule}"
                else:
                    reason = (
                        f"the circuit breaker of cluster {cluster} is open: automatic repairs "
                        "are paused, so this one waits for a person's approval"
                    )
            if not await self._take(f"node.{node}", rid, 1, now):
                return
            rem = Remediation(
                id=rid,
                node=node,
                cluster=cluster,
                pool=pool,
                action=action,
                requested_action=rec.action,
                state=state,
                reason=reason,
                requester=Requester(kind="automatic", name="remediator"),
                approver=approver,
                rule=rule + (f"; {r11}" if r11 and r11 not in rule else ""),
                evidence=rec.evidence,
                severity=rec.severity,
                alert_ids=[rec.alert_id],
                generation=rec.generation,
                ladder_key=rec.ladder_key,
                kind=rec.kind,
                xid=rec.xid,
                created_time=now,
                approved_time=now if approver else None,
                history=[Transition(state=state, time=now, by=self.replica, reason=reason)],
            )
            revision = await self.rem_bucket.create(rid, rem)
            if revision is None:
                metrics.CONFLICTS.labels("remediation").inc()
                return
            self.rems.apply(rid, rem, revision)
            self._rems_of.setdefault(node, set()).add(rid)
            metrics.TRANSITIONS.labels(state.value).inc()
            self._rem_event(rem, revision)
            await self._mutate(self.rec_bucket, self.recs, rec.id, _link(rid, rec.generation))
            return

    def _policies(self) -> dict[str, Policy]:
        return {key: item.value for key, item in self.policies.items()}

    async def _breaker_admit(self, cluster: str, rid: str, now: datetime) -> bool:
        admitted = True
        size = self._cluster_size(cluster)

        def change(current: Breaker | None) -> Breaker | None:
            nonlocal admitted
            new, admitted = guardrails.breaker_admit(
                current, cluster, rid, size, now, self.settings
            )
            return new

        before = self.breakers.get(cluster)
        written = await self._mutate(
            self.breaker_bucket, self.breakers, cluster, change, exact=True
        )
        if written is not None and written.value.open and not (before and before.value.open):
            metrics.BREAKER_TRIPS.labels(cluster).inc()
            log.warning("breaker of cluster %s opened: %s", cluster, written.value.opened_reason)
        return admitted

    async def _take(self, scope: str, holder: str, limit: int, now: datetime) -> bool:
        def change(current: RepairSlots | None) -> RepairSlots | None:
            live = self._live if scope.startswith("node.") else self._live_starting
            taken = guardrails.take_slot(
                current, scope, holder, limit, live, now, self.settings.slot_grace
            )
            if taken is None:
                raise _Full
            return None if taken is current else taken

        try:
            await self._mutate(self.slot_bucket, self._slots, scope, change, exact=True)
        except _Full:
            return False
        return True

    async def _release(self, scope: str, holder: str) -> None:
        await self._mutate(
            self.slot_bucket,
            self._slots,
            scope,
            lambda current: guardrails.release_slot(current, holder),
            exact=True,
        )

    # -- the state machine (R6, R12, R14, R15) ---------------------------------------------------

    async def _advance(self, rid: str, now: datetime) -> None:
        current = self.rems[rid]
        rem = current.value
        if rem.state in (
            RemediationState.PENDING,
            RemediationState.APPROVED,
            RemediationState.WAITING_IDLE,
        ):
            if rem.alert_ids and not any(
                (a := self.alerts.get(i)) is not None and a.value.state is AlertState.FIRING
                for i in rem.alert_ids
            ):
                await self._write(
                    current,
                    lifecycle.finish(
                        rem,
                        Outcome.SELF_RESOLVED,
                        now,
                        self.replica,
                        "its alert cleared before the repair started: the recommendation "
                        "disappeared with it (R13)",
                    ),
                )
                return
            if rem.state is not RemediationState.PENDING and self._held_by_breaker(rem):
                await self._hold(current, now)
                return
        if rem.state is RemediationState.PENDING:
            return
        if rem.state is RemediationState.APPROVED:
            await self._cordon(rem, now)
            pol = policy.effective(self._policies(), rem.cluster)
            await self._write(current, lifecycle.start_waiting(rem, pol, now, self.replica))
            return
        if rem.state is RemediationState.WAITING_IDLE:
            await self._maybe_start(current, now)
            return
        if rem.state is RemediationState.RUNNING:
            await self._run(current, now)
            return
        if rem.state is RemediationState.REVALIDATING:
            await self._revalidate(current, now)

    def _held_by_breaker(self, rem: Remediation) -> bool:
        if rem.requester.kind != "automatic" or rem.approver is None:
            return False
        if rem.approver.kind != "policy":
            return False
        breaker = self.breakers.get(rem.cluster)
        return breaker is not None and breaker.value.open

    async def _hold(self, current: Versioned[Remediation], now: datetime) -> None:
        """The breaker opened before this automatic repair started: back to a person; when the
        breaker closes it is not replayed (R13)."""
        rem = current.value
        await self._mutate(
            self.breaker_bucket,
            self.breakers,
            rem.cluster,
            lambda b: guardrails.breaker_hold(b, rem.id) if b is not None else None,
        )
        written = await self._write(
            current,
            lifecycle.move(
                rem,
                RemediationState.PENDING,
                now,
                self.replica,
                f"held by the circuit breaker of cluster {rem.cluster}: it waits for a person's "
                "approval and is not replayed when the breaker is reset",
                approver=None,
                approved_time=None,
                wait_start_time=None,
                idle_deadline_time=None,
            ),
        )
        if written is not None:
            await self._lift_cordon(rem.node)
            await self._release(f"pool.{rem.pool}", rem.id)
            await self._release(f"cluster.{rem.cluster}", rem.id)
        metrics.GUARDRAIL_WAITS.labels("breaker").inc()

    async def _maybe_start(self, current: Versioned[Remediation], now: datetime) -> None:
        rem = current.value
        held = self.leases.get(rem.node)
        running = [held.value.gang] if held is not None else []
        idle = lifecycle.idle_decision(rem, running, now)
        if not idle.go:
            await self._wait(current, "idle", idle.reason)
            return
        last: datetime | None = None
        for other_id in self._rems_of.get(rem.node, set()):
            other = self.rems.get(other_id)
            if other is None or other.key == rem.id or other.value.finished_time is None:
                continue
            if other.value.outcome in (Outcome.DONE, Outcome.FAILED):
                if last is None or other.value.finished_time > last:
                    last = other.value.finished_time
        until = guardrails.cooldown_until(last, self.settings)
        if until is not None and now < until:
            await self._wait(
                current,
                "cooldown",
                f"cooldown after the last repair of {rem.node} until {until:%Y-%m-%dT%H:%M:%S}Z",
            )
            return
        if not await self.provider.has_capacity(rem.node, rem.action):
            await self._wait(current, "capacity", f"no capacity for {rem.action.value} now")
            return
        limit = guardrails.budget(self._cluster_size(rem.cluster), self.settings)
        if not await self._take(f"pool.{rem.pool}", rem.id, 1, now):
            await self._wait(
                current, "pool", f"another repair runs in node pool {rem.pool} (one at a time)"
            )
            return
        if not await self._take(f"cluster.{rem.cluster}", rem.id, limit, now):
            await self._release(f"pool.{rem.pool}", rem.id)
            await self._wait(
                current,
                "budget",
                f"the concurrency budget of cluster {rem.cluster} ({limit} at once) is spent",
            )
            return
        health = self.health.get(rem.node)
        host, _ = await self.provider.host(rem.node)
        started = lifecycle.move(
            rem,
            RemediationState.RUNNING,
            now,
            self.replica,
            f"{rem.action.value} starts: {idle.reason}",
            started_time=now,
            op_id=f"{rem.id}.op",
            executor=self.replica,
            claim_time=now,
            boot_id_before=health.value.boot_id if health else "",
            host_before=host,
            interrupted=idle.interrupt,
        )
        written = await self._write(current, started)
        if written is None:
            return
        if idle.interrupt and held is not None:
            await restart_gangs(self.bus, rem.node, [held.value], rem.id)
        await self._run(written, now)

    async def _wait(self, current: Versioned[Remediation], guardrail: str, reason: str) -> None:
        if current.value.reason == reason:
            return
        metrics.GUARDRAIL_WAITS.labels(guardrail).inc()
        await self._write(current, msgspec.structs.replace(current.value, reason=reason))

    async def _run(self, current: Versioned[Remediation], now: datetime) -> None:
        rem = current.value
        health = self.health.get(rem.node)
        boot_id = health.value.boot_id if health else ""
        if rem.issued_time is None:
            mine = rem.executor == self.replica
            stale = rem.claim_time is None or now - rem.claim_time > self.settings.claim_grace
            if not mine and not stale:
                return  # the replica that claimed it issues it
            if not mine:
                claimed = await self._write(
                    current,
                    msgspec.structs.replace(rem, executor=self.replica, claim_time=now),
                )
                if claimed is None:
                    return
                current, rem = claimed, claimed.value
            executed = await self.provider.executed(rem.node, rem.op_id)
            decision, why = lifecycle.issue_decision(rem, boot_id, executed)
            if decision == "issue":
                try:
                    await self.provider.execute(rem.node, rem.action, rem.op_id)
                except Exception as error:  # retried on the next tick, up to the timeout
                    if lifecycle.timed_out(rem, now, self.settings.action_timeout):
                        await self._write(
                            current,
                            lifecycle.finish(
                                rem,
                                Outcome.FAILED,
                                now,
                                self.replica,
                                f"{rem.action.value} could not be carried out: {error}",
                            ),
                        )
                    else:
                        await self._wait(current, "provider", f"{rem.action.value}: {error}")
                    return
                reason = f"{rem.action.value} issued; waiting for {rem.node} to come back"
            else:
                reason = f"{rem.action.value} not issued again: {why}"
            await self._write(
                current,
                msgspec.structs.replace(
                    rem, issued_time=self.clock(), issue_skipped=why, reason=reason
                ),
            )
            return
        host, retired = await self.provider.host(rem.node)
        if lifecycle.came_back(rem, boot_id, host, retired):
            await self._write(
                current,
                lifecycle.move(
                    rem,
                    RemediationState.REVALIDATING,
                    now,
                    self.replica,
                    "the machine came back; running diagnostics before it rejoins (R15)",
                    back_time=now,
                    host_after=host,
                ),
            )
            return
        if lifecycle.timed_out(rem, now, self.settings.action_timeout):
            await self._write(
                current,
                lifecycle.finish(
                    rem,
                    Outcome.FAILED,
                    now,
                    self.replica,
                    f"{rem.node} did not come back within {self.settings.action_timeout}",
                ),
            )

    async def _revalidate(self, current: Versioned[Remediation], now: datetime) -> None:
        rem = current.value
        if rem.action is Action.DELETE:
            await self._hold_forever(rem, now)
            await self._write(
                current,
                lifecycle.finish(
                    rem,
                    Outcome.DONE,
                    now,
                    self.replica,
                    "retired; its host went straight to revalidation (R15)",
                ),
            )
            return
        failures = await self.provider.diagnose(rem.node)
        if failures:
            await self._write(
                current,
                lifecycle.finish(
                    rem,
                    Outcome.FAILED,
                    now,
                    self.replica,
                    "diagnostics failed: the node stays out of service",
                    diagnostics=failures,
                ),
            )
        else:
            await self._write(
                current,
                lifecycle.finish(
                    rem,
                    Outcome.DONE,
                    now,
                    self.replica,
                    "diagnostics passed: the node rejoins",
                    diagnostics=[],
                ),
            )

    async def _settle(self, rid: str, now: datetime) -> None:
        """After the end: slots released, the ladder and the alert told, the cordon lifted when
        the node is healthy. Each step is idempotent; `settled` records that all ran."""
        current = self.rems[rid]
        rem = current.value
        for scope in (f"node.{rem.node}", f"pool.{rem.pool}", f"cluster.{rem.cluster}"):
            await self._release(scope, rid)
        if rem.ladder_key and rem.outcome is not None and rem.started_time is not None:
            attempt = LadderAttempt(
                remediation_id=rid,
                action=rem.requested_action,
                time=rem.started_time,
                outcome=rem.outcome,
            )
            await self._mutate(
                self.ladder_bucket,
                self.ladders,
                rem.ladder_key,
                lambda lad: ladder.record(
                    lad, rem.ladder_key, rem.node, rem.cluster, rem.kind, rem.xid, attempt, now
                ),
            )
        if rem.outcome in (Outcome.DONE, Outcome.FAILED):
            for aid in rem.alert_ids:
                await self._mutate(
                    self.alert_bucket,
                    self.alerts,
                    aid,
                    lambda a: alert_rules.after_repair(a, rem.generation, now) if a else None,
                )
        if rem.outcome is not Outcome.FAILED:
            await self._lift_cordon(rem.node)
        if rem.outcome is not None:
            metrics.REMEDIATIONS.labels(rem.action.value, rem.outcome.value).inc()
        await self._write(current, msgspec.structs.replace(rem, settled=True), event=False)

    # -- cordons ---------------------------------------------------------------------------------

    async def _cordon(self, rem: Remediation, now: datetime) -> None:
        hold = CordonHold(
            by=REMEDIATOR_HOLD,
            reason=f"{rem.action.value} by remediation {rem.id}",
            time=now,
            remediation_id=rem.id,
        )

        def change(current: Cordon | None) -> Cordon | None:
            cordon = current or Cordon(node=rem.node)
            if cordon.holds.get(REMEDIATOR_HOLD, None) == hold or (
                (held := cordon.holds.get(REMEDIATOR_HOLD)) and held.remediation_id == rem.id
            ):
                return None
            return msgspec.structs.replace(cordon, holds={**cordon.holds, REMEDIATOR_HOLD: hold})

        await self._mutate(self.cordon_bucket, self.cordons, rem.node, change)

    async def _hold_forever(self, rem: Remediation, now: datetime) -> None:
        hold = CordonHold(
            by=RETIRED_HOLD,
            reason=f"retired by remediation {rem.id}",
            time=now,
            remediation_id=rem.id,
        )

        def change(current: Cordon | None) -> Cordon | None:
            cordon = current or Cordon(node=rem.node)
            if RETIRED_HOLD in cordon.holds:
                return None
            return msgspec.structs.replace(cordon, holds={**cordon.holds, RETIRED_HOLD: hold})

        await self._mutate(self.cordon_bucket, self.cordons, rem.node, change)

    async def _lift_cordon(self, node: str) -> None:
        """Lifts the remediator's own hold only, and only when no approved repair of the node
        still needs it; holds placed by anyone else stay."""
        if any(r.state is not RemediationState.PENDING for r in self._active_of(node)):
            return

        def change(current: Cordon | None) -> Cordon | None:
            if current is None or REMEDIATOR_HOLD not in current.holds:
                return None
            holds = {k: v for k, v in current.holds.items() if k != REMEDIATOR_HOLD}
            return msgspec.structs.replace(current, holds=holds)

        await self._mutate(self.cordon_bucket, self.cordons, node, change)

    async def _lift_cordon_if_healthy(self, node: str) -> None:
        """A hold kept after a failed repair goes once the node has no active repair and no
        firing alert that needs one."""
        cordon = self.cordons.get(node)
        if cordon is None or REMEDIATOR_HOLD not in cordon.value.holds or self._active_of(node):
            return
        for aid in self._alerts_of.get(node, set()):
            alert = self.alerts.get(aid)
            if (
                alert is not None
                and alert.value.state is AlertState.FIRING
                and alert.value.action is not Action.NONE
            ):
                return
        await self._lift_cordon(node)

    # -- writes ----------------------------------------------------------------------------------

    async def _mutate(
        self,
        bucket: Bucket[S],
        view: _View[S],
        key: str,
        change: Callable[[S | None], S | None],
        exact: bool = False,
    ) -> Versioned[S] | None:
        """Compare-and-set from what the view holds (no read when it is current); when the
        view was stale the write is refused and it is done again from a fresh read. With
        `exact`, a "nothing to change" or a refusal decided on the view is checked again on a
        fresh read too (the breaker and the slots count exactly)."""
        cached = view.get(key)
        try:
            new = change(cached.value if cached else None)
        except _Full:
            new = None
            if not exact:
                raise
        if new is not None:
            if cached is None:
                revision = await bucket.create(key, new)
            else:
                revision = await bucket.update(key, new, cached.revision)
            if revision is not None:
                view.apply(key, new, revision)
                return Versioned(key, new, revision)
        elif not exact:
            return None
        written = await bucket.mutate(key, change)
        if written is not None:
            view.apply(key, written.value, written.revision)
        return written

    async def _write(
        self, current: Versioned[Remediation], new: Remediation, event: bool = True
    ) -> Versioned[Remediation] | None:
        """Compare-and-set on the revision we decided from; a lost race re-reads and the node
        is reconciled again with the winner's record."""
        revision = await self.rem_bucket.update(current.key, new, current.revision)
        if revision is None:
            metrics.CONFLICTS.labels("remediation").inc()
            fresh = await self.rem_bucket.get(current.key)
            if fresh is not None:
                self.rems.apply(current.key, fresh.value, fresh.revision)
            self.mark(new.node)
            return None
        self.rems.apply(current.key, new, revision)
        if new.state is not current.value.state:
            metrics.TRANSITIONS.labels(new.state.value).inc()
            log.info(
                "%s %s -> %s: %s", new.id, current.value.state.value, new.state.value, new.reason
            )
        if event and new.state is not current.value.state:
            self._rem_event(new, revision)
        return Versioned(current.key, new, revision)

    def _rem_event(self, rem: Remediation, revision: int) -> None:
        self._event(
            names.remediation_event(rem.node, rem.state.value.lower()), rem, f"{rem.id}.{revision}"
        )

    def _event(self, subject: str, body: msgspec.Struct, dedup: str) -> None:
        async def publish() -> None:
            try:
                await self.bus.publish(subject, body, dedup_id=dedup)
            except Exception as error:
                log.warning("event %s not published: %s", subject, error)

        task = asyncio.create_task(publish())
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _link(rid: str, generation: int) -> Callable[[Recommendation | None], Recommendation | None]:
    def change(rec: Recommendation | None) -> Recommendation | None:
        if rec is None or rec.generation != generation or rec.remediation_id == rid:
            return None
        return msgspec.structs.replace(rec, remediation_id=rid)

    return change


class _Live:
    """Holders of slots that still hold them: a node's slot belongs to any repair not ended;
    a pool's or a cluster's only to repairs starting or under way (not back with a person)."""

    STARTING = frozenset(
        {RemediationState.WAITING_IDLE, RemediationState.RUNNING, RemediationState.REVALIDATING}
    )

    def __init__(self, rems: _View[Remediation], starting: bool) -> None:
        self._rems = rems
        self._starting = starting

    def __contains__(self, holder: object) -> bool:
        found = self._rems.get(str(holder))
        if found is None:
            return False
        if self._starting:
            return found.value.state in self.STARTING
        return found.value.active


class _Full(Exception):
    """A slot scope is full."""

"""The remediator's records: the KV buckets it reads and writes, a view of each that its watch
keeps current, the indexes over them (a node's alerts and remediations, a cluster's nodes), the
signal reports waiting to be applied, and the writes: compare-and-set from the view, and the
events that tell what changed.

A change that concerns a node wakes it (`wake`, the reconcile loop's mark); the store decides
nothing itself."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from datetime import datetime
from typing import Any, TypeVar

import msgspec

from libs.bus import Bus, Versioned
from libs.bus.kv import Bucket
from libs.contracts import names
from libs.contracts.epochs import Lease
from libs.contracts.fleet import NodeHealth, NodeRecord
from libs.contracts.remediation import (
    Alert,
    AlertState,
    Breaker,
    Cordon,
    Ladder,
    NodeLabels,
    Policy,
    Recommendation,
    Remediation,
    RepairSlots,
    SignalReport,
)
from libs.runtime.tasks import TaskSet
from services.remediator import metrics

log = logging.getLogger("nodus.remediator")

S = TypeVar("S", bound=msgspec.Struct)


class View(dict[str, Versioned[S]]):
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


class Refused(Exception):
    """A change refuses to be made (a slot scope is full); with `exact`, `Store.mutate` asks
    again on a fresh read before it believes the view."""


class Store:
    def __init__(self, bus: Bus, wake: Callable[[str], None]) -> None:
        self.bus = bus
        self.wake = wake
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
        self.label_bucket = bus.bucket(names.BUCKET_NODE_LABELS, NodeLabels)  # read on request
        self.health_bucket = bus.bucket(names.BUCKET_HEALTH, NodeHealth)
        self.lease_bucket = bus.bucket(names.BUCKET_LEASES, Lease)
        self.alerts: View[Alert] = View()
        self.recs: View[Recommendation] = View()
        self.rems: View[Remediation] = View()
        self.policies: View[Policy] = View()
        self.ladders: View[Ladder] = View()
        self.breakers: View[Breaker] = View()
        self.cordons: View[Cordon] = View()
        self.nodes: View[NodeRecord] = View()
        self.health: View[NodeHealth] = View()
        self.leases: View[Lease] = View()
        self.slots: View[RepairSlots] = View()  # our own writes only; checked by CAS
        self.alerts_of: dict[str, set[str]] = {}
        self.rems_of: dict[str, set[str]] = {}
        self.clusters: dict[str, set[str]] = {}
        self.reports: dict[str, dict[str, tuple[SignalReport, float]]] = {}
        self._last_report: dict[str, datetime] = {}
        self._tasks = TaskSet("remediator store", log)  # the watches and the events

    # -- start and stop ------------------------------------------------------------------------

    async def start(self) -> None:
        """Returns once every view holds what its bucket held, then the signal reports."""
        watched: list[tuple[Bucket[Any], View[Any], Callable[[str, Any], None] | None]] = [
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
        for (bucket, view, hook), event in zip(watched, caught_up, strict=True):
            self._tasks.spawn(self._watch(bucket, view, hook, event), name=f"watch {bucket.name}")
        await asyncio.gather(*(event.wait() for event in caught_up))
        signals_caught_up = asyncio.Event()
        self._tasks.spawn(self._watch_signals(signals_caught_up), name="watch signals")
        await signals_caught_up.wait()

    async def stop(self) -> None:
        await self._tasks.close()

    # -- watches -------------------------------------------------------------------------------

    async def _watch(
        self,
        bucket: Bucket[Any],
        view: View[Any],
        hook: Callable[[str, Any], None] | None,
        caught_up: asyncio.Event,
    ) -> None:
        async for change in bucket.watch(caught_up=caught_up):
            if view.apply(change.key, change.value, change.revision) and hook is not None:
                hook(change.key, change.value)

    def _on_node(self, key: str, record: NodeRecord | None) -> None:
        for members in self.clusters.values():
            members.discard(key)
        if record is not None:
            self.clusters.setdefault(record.inventory.cluster, set()).add(key)

    def _on_health(self, key: str, _: object) -> None:
        if self.active_of(key):
            self.wake(key)

    def _on_lease(self, key: str, _: object) -> None:
        if self.active_of(key):
            self.wake(key)

    def _on_alert(self, key: str, alert: Alert | None) -> None:
        node = key.split(".", 1)[0]
        if alert is None:
            self.alerts_of.get(node, set()).discard(key)
        else:
            self.alerts_of.setdefault(alert.node, set()).add(key)
        self.wake(node)

    def _on_rec(self, key: str, _: object) -> None:
        self.wake(key.split(".", 1)[0])

    def _on_rem(self, key: str, rem: Remediation | None) -> None:
        node = key.split(".", 1)[0]
        if rem is not None:
            self.rems_of.setdefault(rem.node, set()).add(key)
        self.wake(node)

    def _on_policy(self, _: str, __: object) -> None:
        for node in list(self.alerts_of):
            self.wake(node)

    def _on_breaker(self, key: str, breaker: Breaker | None) -> None:
        metrics.BREAKER_OPEN.labels(key).set(1 if breaker is not None and breaker.open else 0)
        for node in self.clusters.get(key, set()):
            if self.rems_of.get(node):
                self.wake(node)

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
            self.reports.setdefault(report.node, {})[report.source] = (report, received)
            self.wake(report.node)

    # -- what the views say ----------------------------------------------------------------------

    def take_reports(self, node: str) -> list[tuple[SignalReport, float]]:
        """The node's reports not applied yet (the latest of each source), with when each came."""
        return list(self.reports.pop(node, {}).values())

    def active_of(self, node: str) -> list[Remediation]:
        return [
            r.value
            for i in self.rems_of.get(node, set())
            if (r := self.rems.get(i)) is not None and r.value.active
        ]

    def firing_of(self, node: str) -> list[Alert]:
        return [
            a.value
            for i in self.alerts_of.get(node, set())
            if (a := self.alerts.get(i)) is not None and a.value.state is AlertState.FIRING
        ]

    def cluster_size(self, cluster: str) -> int:
        return len(self.clusters.get(cluster, set()))

    def policy_records(self) -> dict[str, Policy]:
        return {key: item.value for key, item in self.policies.items()}

    # -- writes ----------------------------------------------------------------------------------

    async def mutate(
        self,
        bucket: Bucket[S],
        view: View[S],
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
        except Refused:
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

    async def write(
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
            self.wake(new.node)
            return None
        self.rems.apply(current.key, new, revision)
        if new.state is not current.value.state:
            metrics.TRANSITIONS.labels(new.state.value).inc()
            log.info(
                "%s %s -> %s: %s", new.id, current.value.state.value, new.state.value, new.reason
            )
        if event and new.state is not current.value.state:
            self.rem_event(new, revision)
        return Versioned(current.key, new, revision)

    async def create(self, rem: Remediation) -> int | None:
        """A new remediation, told; None when its id exists already (another replica's)."""
        revision = await self.rem_bucket.create(rem.id, rem)
        if revision is None:
            return None
        self.rems.apply(rem.id, rem, revision)
        self.rems_of.setdefault(rem.node, set()).add(rem.id)
        self.rem_event(rem, revision)
        return revision

    def rem_event(self, rem: Remediation, revision: int) -> None:
        self.event(
            names.remediation_event(rem.node, rem.state.value.lower()), rem, f"{rem.id}.{revision}"
        )

    def event(self, subject: str, body: msgspec.Struct, dedup: str) -> None:
        async def publish() -> None:
            try:
                await self.bus.publish(subject, body, dedup_id=dedup)
            except Exception as error:
                log.warning("event %s not published: %s", subject, error)

        self._tasks.spawn(publish(), name=f"publish {subject}")

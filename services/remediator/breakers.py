"""The circuit breaker of each cluster on the bus (R13): automatic repairs are counted as they
are approved by policy; a surge opens it, and what it holds back goes to a person. Only a
person closes it (the API's reset)."""

from __future__ import annotations

import logging
from datetime import datetime

from libs.contracts.remediation import Breaker, Remediation
from services.remediator import guardrails, metrics
from services.remediator.store import Store

log = logging.getLogger("nodus.remediator")


class Breakers:
    def __init__(self, store: Store, settings: guardrails.Settings) -> None:
        self.store = store
        self.settings = settings

    async def admit(self, cluster: str, rid: str, now: datetime) -> bool:
        admitted = True
        size = self.store.cluster_size(cluster)

        def change(current: Breaker | None) -> Breaker | None:
            nonlocal admitted
            new, admitted = guardrails.breaker_admit(
                current, cluster, rid, size, now, self.settings
            )
            return new

        before = self.store.breakers.get(cluster)
        written = await self.store.mutate(
            self.store.breaker_bucket, self.store.breakers, cluster, change, exact=True
        )
        if written is not None and written.value.open and not (before and before.value.open):
            metrics.BREAKER_TRIPS.labels(cluster).inc()
            log.warning("breaker of cluster %s opened: %s", cluster, written.value.opened_reason)
        return admitted

    def holds_back(self, rem: Remediation) -> bool:
        """An automatic repair approved by policy, in a cluster whose breaker is open."""
        if rem.requester.kind != "automatic" or rem.approver is None:
            return False
        if rem.approver.kind != "policy":
            return False
        breaker = self.store.breakers.get(rem.cluster)
        return breaker is not None and breaker.value.open

    async def hold(self, rem: Remediation) -> None:
        await self.store.mutate(
            self.store.breaker_bucket,
            self.store.breakers,
            rem.cluster,
            lambda b: guardrails.breaker_hold(b, rem.id) if b is not None else None,
        )

    async def reset(self, cluster: str, by: str, now: datetime) -> Breaker:
        written = await self.store.mutate(
            self.store.breaker_bucket,
            self.store.breakers,
            cluster,
            lambda b: guardrails.breaker_reset(b, cluster, by, now),
        )
        log.warning("breaker of cluster %s reset by %s", cluster, by)
        return written.value if written else Breaker(cluster=cluster)

"""Recommendations to remediations (R3, R5, R7, R13): a persisting recommendation with a failed
check becomes a remediation, approved by policy (while the cluster's breaker admits it) or
waiting for a person; one repair at a time per node. Its id comes from the alert and its
generation, so replicas that race create one."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

import msgspec

from libs.contracts.remediation import (
    Approver,
    Recommendation,
    Remediation,
    RemediationState,
    Requester,
    Transition,
)
from services.remediator import ladder, metrics, policy
from services.remediator.breakers import Breakers
from services.remediator.cordons import Cordons
from services.remediator.decide import effective_action, has_failed_check
from services.remediator.lifecycle import remediation_id
from services.remediator.slots import Slots
from services.remediator.store import Store


class Intake:
    def __init__(
        self, store: Store, slots: Slots, breakers: Breakers, cordons: Cordons, replica: str
    ) -> None:
        self.store = store
        self.slots = slots
        self.breakers = breakers
        self.cordons = cordons
        self.replica = replica

    async def create(self, node: str, now: datetime) -> None:
        store = self.store
        record = store.nodes.get(node)
        if record is None:
            return  # an unknown node cannot be placed in a cluster or pool: wait for it
        if self.cordons.retired(node):
            return  # retired (deleted): nothing more to repair here
        active = store.active_of(node)
        candidates = sorted(
            (
                found.value
                for aid in store.alerts_of.get(node, set())
                if (found := store.recs.get(aid)) is not None
            ),
            key=lambda r: (-ladder.RUNG.get(r.action, 0), r.severity != "critical", r.id),
        )
        for rec in candidates:
            rid = remediation_id(node, rec.alert_id, rec.generation)
            if rid in store.rems:
                if rec.remediation_id != rid:  # created by a replica that stopped before this
                    await store.mutate(
                        store.rec_bucket, store.recs, rec.id, _link(rid, rec.generation)
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
                policy.effective(store.policy_records(), cluster), node, rec.action, rec.xid
            )
            rule = rec.rule
            approver = None
            state = RemediationState.PENDING
            reason = f"waiting for a person's approval ({decided.rule})"
            if decided.automatic:
                admitted = await self.breakers.admit(cluster, rid, now)
                if admitted:
                    approver = Approver(kind="policy", name="policy", rule=decided.rule)
                    state = RemediationState.APPROVED
                    reason = f"approved by policy: {decided.rule}"
                else:
                    reason = (
                        f"the circuit breaker of cluster {cluster} is open: automatic repairs "
                        "are paused, so this one waits for a person's approval"
                    )
            if not await self.slots.take(f"node.{node}", rid, 1, now):
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
            revision = await store.create(rem)
            if revision is None:
                metrics.CONFLICTS.labels("remediation").inc()
                return
            metrics.TRANSITIONS.labels(state.value).inc()
            await store.mutate(store.rec_bucket, store.recs, rec.id, _link(rid, rec.generation))
            return


def _link(rid: str, generation: int) -> Callable[[Recommendation | None], Recommendation | None]:
    def change(rec: Recommendation | None) -> Recommendation | None:
        if rec is None or rec.generation != generation or rec.remediation_id == rid:
            return None
        return msgspec.structs.replace(rec, remediation_id=rid)

    return change

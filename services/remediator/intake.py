"""Recommendations to remediations (R3, R5, R7, R13): a persisting recommendation with a failed
check becomes a remediation, approved by policy (while the cluster's breaker admits it) or
waiting for a person; one repair at a time per node. Its id comes from the alert and its
generation, so replicas that race create one."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

import msgspec

from libs.contracts.fleet import Inventory
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
        """At most one new remediation for the node: for its heaviest recommendation first."""
        record = self.store.nodes.get(node)
        if record is None:
            return  # an unknown node cannot be placed in a cluster or pool: wait for it
        if self.cordons.retired(node):
            return  # retired (deleted): nothing more to repair here
        active = self.store.active_of(node)
        for rec in self._candidates(node):
            rid = remediation_id(node, rec.alert_id, rec.generation)
            if rid in self.store.rems:
                if rec.remediation_id != rid:  # created by a replica that stopped before this
                    await self._link(rec, rid)
                continue
            if any(r.id != rid for r in active):
                return  # one repair at a time per node; this one waits its turn
            if not has_failed_check(rec.evidence):
                continue  # R3
            await self._open(node, rec, rid, record.value.inventory, now)
            return

    def _candidates(self, node: str) -> list[Recommendation]:
        return sorted(
            (
                found.value
                for aid in self.store.alerts_of.get(node, set())
                if (found := self.store.recs.get(aid)) is not None
            ),
            key=lambda r: (-ladder.RUNG.get(r.action, 0), r.severity != "critical", r.id),
        )

    async def _open(
        self, node: str, rec: Recommendation, rid: str, inventory: Inventory, now: datetime
    ) -> None:
        approval = await self._approval(node, rec, rid, inventory.cluster, now)
        if not await self.slots.take(f"node.{node}", rid, 1, now):
            return
        rem = self._remediation(node, rec, rid, inventory, approval, now)
        if await self.store.create(rem) is None:
            metrics.CONFLICTS.labels("remediation").inc()
            return
        metrics.TRANSITIONS.labels(rem.state.value).inc()
        await self._link(rec, rid)

    async def _approval(
        self, node: str, rec: Recommendation, rid: str, cluster: str, now: datetime
    ) -> _Approval:
        """R5: approved by policy when it trusts the action (and the breaker admits one more
        automatic repair); otherwise it waits for a person."""
        decided = policy.approval(
            policy.effective(self.store.policy_records(), cluster), node, rec.action, rec.xid
        )
        if not decided.automatic:
            return _Approval(None, f"waiting for a person's approval ({decided.rule})")
        if not await self.breakers.admit(cluster, rid, now):
            return _Approval(
                None,
                f"the circuit breaker of cluster {cluster} is open: automatic repairs "
                "are paused, so this one waits for a person's approval",
            )
        return _Approval(
            Approver(kind="policy", name="policy", rule=decided.rule),
            f"approved by policy: {decided.rule}",
        )

    def _remediation(
        self,
        node: str,
        rec: Recommendation,
        rid: str,
        inventory: Inventory,
        approval: _Approval,
        now: datetime,
    ) -> Remediation:
        action, r11 = effective_action(rec.action, rec.evidence)
        state = RemediationState.APPROVED if approval.approver else RemediationState.PENDING
        reason = approval.reason
        return Remediation(
            id=rid,
            node=node,
            cluster=inventory.cluster,
            pool=inventory.pool,
            action=action,
            requested_action=rec.action,
            state=state,
            reason=reason,
            requester=Requester(kind="automatic", name="remediator"),
            approver=approval.approver,
            rule=rec.rule + (f"; {r11}" if r11 and r11 not in rec.rule else ""),
            evidence=rec.evidence,
            severity=rec.severity,
            alert_ids=[rec.alert_id],
            generation=rec.generation,
            ladder_key=rec.ladder_key,
            kind=rec.kind,
            xid=rec.xid,
            created_time=now,
            approved_time=now if approval.approver else None,
            history=[Transition(state=state, time=now, by=self.replica, reason=reason)],
            breaks_workload=rec.breaks_workload,
        )

    async def _link(self, rec: Recommendation, rid: str) -> None:
        """The recommendation names the remediation made of it."""

        def change(current: Recommendation | None) -> Recommendation | None:
            if current is None or current.generation != rec.generation:
                return None
            if current.remediation_id == rid:
                return None
            return msgspec.structs.replace(current, remediation_id=rid)

        await self.store.mutate(self.store.rec_bucket, self.store.recs, rec.id, change)


@dataclass(frozen=True, slots=True)
class _Approval:
    approver: Approver | None  # None: it waits for a person
    reason: str

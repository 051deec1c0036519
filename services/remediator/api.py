"""The remediator's request/reply API (R5, R7, R8, R13): approvals and cancellations by
people, repair requests from external detectors, breaker resets. Each answer is a record the
CLI prints as is; each refusal a readable error with a stable code."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from libs.bus import Versioned
from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.remediation import (
    Action,
    Approver,
    ApproveRequest,
    BreakerReply,
    BreakerResetRequest,
    CancelRequest,
    Outcome,
    Remediation,
    RemediationReply,
    RemediationState,
    RepairRequest,
    Requester,
    Transition,
)
from services.remediator import guardrails, lifecycle, metrics
from services.remediator.breakers import Breakers
from services.remediator.decide import effective_action, has_critical, has_failed_check
from services.remediator.lifecycle import remediation_id
from services.remediator.provider import MachineProvider
from services.remediator.slots import Slots
from services.remediator.store import Store

EXTERNAL_ACTIONS = (Action.REBOOT, Action.REPROVISION, Action.MIGRATE)


class Api:
    def __init__(
        self,
        store: Store,
        slots: Slots,
        breakers: Breakers,
        provider: MachineProvider,
        settings: guardrails.Settings,
        clock: Callable[[], datetime],
    ) -> None:
        self.store = store
        self.slots = slots
        self.breakers = breakers
        self.provider = provider
        self.settings = settings
        self.clock = clock

    async def _find(self, ident: str) -> Versioned[Remediation]:
        """By remediation id, or by the id of the recommendation (alert) it came from; from
        the bus when this replica's view has not seen it yet."""
        found = self.store.rems.get(ident) or await self.store.rem_bucket.get(ident)
        if found is None:
            rec = self.store.recs.get(ident) or await self.store.rec_bucket.get(ident)
            if rec is not None and rec.value.remediation_id:
                rid = rec.value.remediation_id
                found = self.store.rems.get(rid) or await self.store.rem_bucket.get(rid)
        if found is None:
            raise NodusError(ErrorCode.NOT_FOUND, f"no remediation or recommendation {ident}")
        self.store.rems.apply(found.key, found.value, found.revision)
        return found

    async def _change(
        self, rid: str, change: Callable[[Remediation | None], Remediation | None]
    ) -> RemediationReply:
        """A person's change of a remediation, told; the record as it stands is the answer."""
        written = await self.store.mutate(self.store.rem_bucket, self.store.rems, rid, change)
        rem = written.value if written else self.store.rems[rid].value
        if written is not None:
            self.store.rem_event(rem, written.revision)
        self.store.wake(rem.node)
        return RemediationReply(remediation=rem)

    async def approve(self, request: ApproveRequest) -> RemediationReply:
        now = self.clock()
        rid = (await self._find(request.id)).key
        approver = Approver(kind="human", name=request.approver, rule="approved by a person")

        def change(rem: Remediation | None) -> Remediation | None:
            if rem is None:
                raise NodusError(ErrorCode.NOT_FOUND, f"remediation {rid} is gone")
            if rem.state is not RemediationState.PENDING:
                if rem.active:
                    return None  # approved already
                raise NodusError(
                    ErrorCode.CONFLICT,
                    f"remediation {rid} ended ({rem.state.value}); nothing to approve",
                )
            return lifecycle.approve(rem, approver, now)

        return await self._change(rid, change)

    async def cancel(self, request: CancelRequest) -> RemediationReply:
        rid = (await self._find(request.id)).key
        now = self.clock()

        def change(rem: Remediation | None) -> Remediation | None:
            if rem is None:
                raise NodusError(ErrorCode.NOT_FOUND, f"remediation {rid} is gone")
            if not rem.active:
                return None
            if rem.state in (RemediationState.RUNNING, RemediationState.REVALIDATING):
                raise NodusError(
                    ErrorCode.CONFLICT,
                    f"remediation {rid} is {rem.state.value}: a repair is not stopped half-way",
                )
            reason = f"cancelled by {request.by}" + (
                f": {request.reason}" if request.reason else ""
            )
            return lifecycle.finish(rem, Outcome.CANCELLED, now, request.by, reason)

        return await self._change(rid, change)

    async def reset_breaker(self, request: BreakerResetRequest) -> BreakerReply:
        breaker = await self.breakers.reset(request.cluster, request.by, self.clock())
        return BreakerReply(breaker=breaker)

    async def request_repair(self, request: RepairRequest) -> RemediationReply:
        """R8: recorded as an external requester; (detector, request id) is idempotent; no
        Delete; skips approval, not the evidence gate, the capacity check, the budget (at
        execution) nor the per-cluster cap."""
        rid = remediation_id(request.node, "external", request.detector, request.request_id)
        existing = self.store.rems.get(rid) or await self.store.rem_bucket.get(rid)
        if existing is not None:
            metrics.EXTERNAL.labels("repeated").inc()
            return RemediationReply(remediation=existing.value, created=False)
        try:
            rem = self._external(request, rid, self.clock())
            if not await self.provider.has_capacity(request.node, rem.action):
                raise NodusError(
                    ErrorCode.CONFLICT, f"no capacity for {rem.action.value} of {request.node} now"
                )
            if not await self.slots.take(f"node.{request.node}", rid, 1, rem.created_time):
                busy = (
                    ", ".join(r.id for r in self.store.active_of(request.node)) or "another repair"
                )
                raise NodusError(
                    ErrorCode.CONFLICT, f"{request.node} is already being repaired ({busy})"
                )
        except NodusError as error:
            metrics.EXTERNAL.labels(error.code.value).inc()
            raise
        if await self.store.create(rem) is None:
            found = await self.store.rem_bucket.get(rid)
            if found is None:
                raise NodusError(ErrorCode.CONFLICT, f"remediation {rid} raced; retry")
            return RemediationReply(remediation=found.value, created=False)
        metrics.EXTERNAL.labels("created").inc()
        self.store.wake(request.node)
        return RemediationReply(remediation=rem, created=True)

    def _external(self, request: RepairRequest, rid: str, now: datetime) -> Remediation:
        _check_request(request)
        record = self.store.nodes.get(request.node)
        if record is None:
            raise NodusError(ErrorCode.NOT_FOUND, f"node {request.node} is not registered")
        cluster, pool = record.value.inventory.cluster, record.value.inventory.pool
        self._check_cap(cluster)
        self._check_capacity(cluster, request.node)
        # R11 looks at the node's own critical alerts too.
        critical = [e for a in self.store.firing_of(request.node) for e in a.evidence]
        action, r11 = effective_action(request.action, [*request.evidence, *critical])
        reason = "external requests skip the approval queue (R8)"
        rule = f"external detector {request.detector} asked {request.action.value}"
        if request.reason:
            rule += f" ({request.reason[:200]})"
        if r11:
            rule += f"; {r11}"
        return Remediation(
            id=rid,
            node=request.node,
            cluster=cluster,
            pool=pool,
            action=action,
            requested_action=request.action,
            state=RemediationState.APPROVED,
            reason=reason,
            requester=Requester(
                kind="external",
                name=f"external:{request.detector}",
                detector=request.detector,
                request_id=request.request_id,
            ),
            approver=Approver(kind="policy", name="policy", rule=reason),
            rule=rule,
            evidence=request.evidence,
            severity="critical" if has_critical(request.evidence) else "warning",
            created_time=now,
            approved_time=now,
            history=[
                Transition(
                    state=RemediationState.APPROVED,
                    time=now,
                    by=f"external:{request.detector}",
                    reason=reason,
                )
            ],
        )

    def _check_cap(self, cluster: str) -> None:
        """R8: at most `external_cap` external repairs under way per cluster."""
        externals = [
            r.value
            for r in self.store.rems.values()
            if r.value.active
            and r.value.cluster == cluster
            and r.value.requester.kind == "external"
        ]
        if len(externals) >= self.settings.external_cap:
            raise NodusError(
                ErrorCode.CONFLICT,
                f"cluster {cluster} already has {len(externals)} external repairs under way "
                f"(per-cluster cap {self.settings.external_cap})",
            )

    def _check_capacity(self, cluster: str, node: str) -> None:
        """The capacity check: the cluster keeps `min_available_fraction` of its nodes in
        service (not under repair, not cordoned) with this one out too."""
        size = self.store.cluster_size(cluster)
        out = {
            r.value.node
            for r in self.store.rems.values()
            if r.value.active and r.value.cluster == cluster
        } | {
            key
            for key, c in self.store.cordons.items()
            if c.value.holds and key in self.store.clusters.get(cluster, set())
        }
        if size and (size - len(out | {node})) / size < self.settings.min_available_fraction:
            raise NodusError(
                ErrorCode.CONFLICT,
                f"capacity check: cluster {cluster} would keep fewer than "
                f"{self.settings.min_available_fraction:.0%} of its {size} nodes in service",
            )


def _check_request(request: RepairRequest) -> None:
    """What an external detector may ask (R8), about one target, with a failed check (R3)."""
    if request.action not in EXTERNAL_ACTIONS:
        raise NodusError(
            ErrorCode.INVALID,
            f"external detectors may ask Reboot, Reprovision or Migrate, not "
            f"{request.action.value}: delete is always a person's decision (R8)",
            field="$.action",
        )
    if any(e.node != request.node for e in request.evidence):
        raise NodusError(
            ErrorCode.INVALID,
            "every piece of evidence must be about the one target node (one target per repair)",
            field="$.evidence",
        )
    if not has_failed_check(request.evidence):
        raise NodusError(
            ErrorCode.INVALID,
            "no failed health check in the evidence (raw lines or values, and not "
            "NotReady alone): no repair without one (R3)",
            field="$.evidence",
        )

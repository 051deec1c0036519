"""The remediator's request/reply API (R5, R7, R8, R13): approvals and cancellations by
people, repair requests from external detectors, breaker resets. Each answer is a record the
CLI prints as is; each refusal a readable error with a stable code."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

from libs.bus import Versioned
from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.remediation import (
    MAX_EVIDENCE_ITEMS,
    Action,
    Approver,
    ApproveRequest,
    BreakerReply,
    BreakerResetRequest,
    CancelRequest,
    Evidence,
    LabelReply,
    LabelRequest,
    Outcome,
    PersonRepairRequest,
    Remediation,
    RemediationReply,
    RemediationState,
    RepairRequest,
    Requester,
    Transition,
)
from services.remediator import guardrails, labels, lifecycle, metrics
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

    async def request_repair(
        self, request: RepairRequest, detector: str, via: str = "api"
    ) -> RemediationReply:
        """R8: recorded as an external requester, the detector the bus named; (detector,
        request id) is idempotent; no Delete; skips approval, not the evidence gate, the
        capacity check, the budget (at execution) nor the per-cluster cap."""
        if request.detector is not None and request.detector != detector:
            raise NodusError(
                ErrorCode.INVALID,
                f"this bus user asks as detector {detector}, not {request.detector}: a detector "
                "speaks only as itself (R8)",
                field="$.detector",
            )
        rid = remediation_id(request.node, "external", detector, request.request_id)

        def build(now: datetime) -> Remediation:
            _check_request(request)
            self._check_cap(self._registered(request.node)[0])
            return self._external(request, detector, via, rid, now)

        return await self._create(rid, request.node, build)

    async def request_by_person(self, request: PersonRepairRequest) -> RemediationReply:
        """A person's request (`nodus repair request --as`): recorded as that person, who also
        approves it by asking; any action, Delete included (R9); the evidence gate (R3), the
        capacity check and one repair per node hold. Detectors cannot send it (S1)."""
        rid = remediation_id(request.node, "human", request.by, request.request_id)

        def build(now: datetime) -> Remediation:
            return self._by_person(request, rid, now)

        return await self._create(rid, request.node, build)

    async def label_node(self, request: LabelRequest, caller: str) -> LabelReply:
        """Set and remove a node's labels as `caller` (the name the bus gave the sender). A
        change that sets the repair labels is that caller's repair request (R8): refused, the
        labels stay as they were; granted or repeated, the node notes the repair it made."""
        self._registered(request.node)
        bucket = self.store.label_bucket
        for _ in range(5):
            current = await bucket.get(request.node)
            now = self.clock()
            changed = labels.apply(current.value if current else None, request, caller, now)
            reply: RemediationReply | None = None
            if labels.asks_repair(request):
                asked = labels.repair_request(changed, caller)
                reply = await self.request_repair(asked, caller, via="label")
                changed = labels.with_remediation(changed, reply.remediation.id, now)
            if current is not None and changed == current.value:
                break
            revision = (
                await bucket.create(request.node, changed)
                if current is None
                else await bucket.update(request.node, changed, current.revision)
            )
            if revision is not None:
                break
            # Another change landed between: again on a fresh read (a repair asked is
            # idempotent, so asking again makes the same one).
        else:
            raise NodusError(
                ErrorCode.CONFLICT, f"the labels of {request.node} keep changing; retry"
            )
        return LabelReply(
            labels=changed,
            remediation=reply.remediation if reply else None,
            created=reply.created if reply else False,
        )

    async def _create(
        self, rid: str, node: str, build: Callable[[datetime], Remediation]
    ) -> RemediationReply:
        """One remediation under a derived id: an existing one is the answer (idempotent); a
        new one takes the node's slot first."""
        existing = self.store.rems.get(rid) or await self.store.rem_bucket.get(rid)
        if existing is not None:
            metrics.EXTERNAL.labels("repeated").inc()
            return RemediationReply(remediation=existing.value, created=False)
        try:
            rem = build(self.clock())
            if not await self.provider.has_capacity(node, rem.action):
                raise NodusError(
                    ErrorCode.CONFLICT, f"no capacity for {rem.action.value} of {node} now"
                )
            if not await self.slots.take(f"node.{node}", rid, 1, rem.created_time):
                busy = ", ".join(r.id for r in self.store.active_of(node)) or "another repair"
                raise NodusError(ErrorCode.CONFLICT, f"{node} is already being repaired ({busy})")
        except NodusError as error:
            metrics.EXTERNAL.labels(error.code.value).inc()
            raise
        if await self.store.create(rem) is None:
            found = await self.store.rem_bucket.get(rid)
            if found is None:
                raise NodusError(ErrorCode.CONFLICT, f"remediation {rid} raced; retry")
            return RemediationReply(remediation=found.value, created=False)
        metrics.EXTERNAL.labels("created").inc()
        self.store.wake(node)
        return RemediationReply(remediation=rem, created=True)

    def _registered(self, node: str) -> tuple[str, str]:
        """The node's cluster and pool; a node nobody registered is not repaired."""
        record = self.store.nodes.get(node)
        if record is None:
            raise NodusError(ErrorCode.NOT_FOUND, f"node {node} is not registered")
        return record.value.inventory.cluster, record.value.inventory.pool

    def _external(
        self, request: RepairRequest, detector: str, via: str, rid: str, now: datetime
    ) -> Remediation:
        # R11 looks at the node's own critical alerts too.
        critical = [e for a in self.store.firing_of(request.node) for e in a.evidence]
        how = "by node label" if via == "label" else "through the API"
        reason = "external requests skip the approval queue (R8)"
        return self._approved(
            rid,
            request.node,
            request.action,
            [*request.evidence, *critical],
            Requester(
                kind="external",
                name=f"external:{detector}",
                detector=detector,
                request_id=request.request_id,
                via="label" if via == "label" else "api",
            ),
            Approver(kind="policy", name="policy", rule=reason),
            _rule(f"external detector {detector} asked {request.action.value} {how}", request),
            reason,
            request.evidence,
            now,
        )

    def _by_person(self, request: PersonRepairRequest, rid: str, now: datetime) -> Remediation:
        _one_target(request.node, request.evidence)
        # The node's own firing alerts are evidence a person may act on.
        evidence = [
            *request.evidence,
            *(e for a in self.store.firing_of(request.node) for e in a.evidence),
        ]
        if not has_failed_check(evidence):
            raise NodusError(
                ErrorCode.INVALID,
                f"{request.node} has no firing alert and the request carries no failed check "
                "(--line or --value): no repair without one (R3)",
                field="$.evidence",
            )
        return self._approved(
            rid,
            request.node,
            request.action,
            evidence,
            Requester(kind="human", name=request.by, request_id=request.request_id, via="api"),
            Approver(kind="human", name=request.by, rule="requested by a person"),
            _rule(f"{request.by} asked {request.action.value}", request),
            "a person asked for it, which approves it",
            evidence[:MAX_EVIDENCE_ITEMS],
            now,
        )

    def _approved(
        self,
        rid: str,
        node: str,
        requested: Action,
        decided_on: list[Evidence],
        requester: Requester,
        approver: Approver,
        rule: str,
        reason: str,
        evidence: list[Evidence],
        now: datetime,
    ) -> Remediation:
        """A repair someone asked for, approved as it is made: past the capacity check, its
        action after R11 on `decided_on`."""
        cluster, pool = self._registered(node)
        self._check_capacity(cluster, node)
        action, r11 = effective_action(requested, decided_on)
        return Remediation(
            id=rid,
            node=node,
            cluster=cluster,
            pool=pool,
            action=action,
            requested_action=requested,
            state=RemediationState.APPROVED,
            reason=reason,
            requester=requester,
            approver=approver,
            rule=f"{rule}; {r11}" if r11 else rule,
            evidence=evidence,
            severity="critical" if has_critical(evidence) else "warning",
            created_time=now,
            approved_time=now,
            history=[
                Transition(
                    state=RemediationState.APPROVED, time=now, by=requester.name, reason=reason
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
    _one_target(request.node, request.evidence)
    if not has_failed_check(request.evidence):
        raise NodusError(
            ErrorCode.INVALID,
            "no failed health check in the evidence (raw lines or values, and not "
            "NotReady alone): no repair without one (R3)",
            field="$.evidence",
        )


def _one_target(node: str, evidence: list[Evidence]) -> None:
    if any(e.node != node for e in evidence):
        raise NodusError(
            ErrorCode.INVALID,
            "every piece of evidence must be about the one target node (one target per repair)",
            field="$.evidence",
        )


def _rule(head: str, request: RepairRequest | PersonRepairRequest) -> str:
    return f"{head} ({request.reason[:200]})" if request.reason else head

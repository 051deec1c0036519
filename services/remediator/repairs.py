"""Each remediation through its states (R6, R12, R14, R15) and, once it ended, settled: the
I/O around the sans-I/O `lifecycle`. Approved: the node is cordoned and the idle wait starts;
waiting for idle: the guardrails are checked and the slots taken; running: the action is issued
once and the machine watched until it comes back; revalidating: diagnostics decide whether it
rejoins. Every step is a compare-and-set on the record it was decided from."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime

import msgspec

from libs.bus import Versioned
from libs.contracts.remediation import (
    Action,
    AlertState,
    LadderAttempt,
    Outcome,
    Remediation,
    RemediationState,
)
from libs.jobs.lifecycle import FAULT_BROKE_MEMBER, NODE_REPAIR
from libs.jobs.store import restart_gang
from services.remediator import alerts as alert_rules
from services.remediator import guardrails, ladder, lifecycle, metrics, policy
from services.remediator.breakers import Breakers
from services.remediator.cordons import Cordons
from services.remediator.provider import MachineProvider, ProviderError
from services.remediator.slots import Slots
from services.remediator.store import Store


class Repairs:
    def __init__(
        self,
        store: Store,
        slots: Slots,
        breakers: Breakers,
        cordons: Cordons,
        provider: MachineProvider,
        settings: guardrails.Settings,
        replica: str,
        clock: Callable[[], datetime],
    ) -> None:
        self.store = store
        self.slots = slots
        self.breakers = breakers
        self.cordons = cordons
        self.provider = provider
        self.settings = settings
        self.replica = replica
        self.clock = clock

    async def advance(self, rid: str, now: datetime) -> None:
        current = self.store.rems[rid]
        rem = current.value
        if rem.state in (
            RemediationState.PENDING,
            RemediationState.APPROVED,
            RemediationState.WAITING_IDLE,
        ):
            if rem.alert_ids and not any(
                (a := self.store.alerts.get(i)) is not None and a.value.state is AlertState.FIRING
                for i in rem.alert_ids
            ):
                await self._finish(
                    current,
                    Outcome.SELF_RESOLVED,
                    now,
                    "its alert cleared before the repair started: the recommendation "
                    "disappeared with it (R13)",
                )
                return
            if rem.state is not RemediationState.PENDING and self.breakers.holds_back(rem):
                await self._hold(current, now)
                return
        if rem.state is RemediationState.PENDING:
            return
        if rem.state is RemediationState.APPROVED:
            await self.cordons.hold(rem, now)
            pol = policy.effective(self.store.policy_records(), rem.cluster)
            await self.store.write(current, lifecycle.start_waiting(rem, pol, now, self.replica))
            return
        if rem.state is RemediationState.WAITING_IDLE:
            await self._maybe_start(current, now)
            return
        if rem.state is RemediationState.RUNNING:
            await self._run(current, now)
            return
        if rem.state is RemediationState.REVALIDATING:
            await self._revalidate(current, now)

    async def _hold(self, current: Versioned[Remediation], now: datetime) -> None:
        """The breaker opened before this automatic repair started: back to a person; when the
        breaker closes it is not replayed (R13)."""
        rem = current.value
        await self.breakers.hold(rem)
        written = await self.store.write(
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
            await self.cordons.lift(rem.node)
            await self.slots.release(f"pool.{rem.pool}", rem.id)
            await self.slots.release(f"cluster.{rem.cluster}", rem.id)
        metrics.GUARDRAIL_WAITS.labels("breaker").inc()

    async def _maybe_start(self, current: Versioned[Remediation], now: datetime) -> None:
        rem = current.value
        held = self.store.leases.get(rem.node)
        running = [held.value.gang] if held is not None else []
        idle = lifecycle.idle_decision(rem, running, now)
        if not idle.go:
            await self._wait(current, "idle", idle.reason)
            return
        if not await self._admitted(current, now):
            return
        health = self.store.health.get(rem.node)
        host, _ = await self.provider.host(rem.node)
        started = lifecycle.move(
            rem,
            RemediationState.RUNNING,
            now,
            self.replica,
            f"{rem.action.value} starts: {idle.reason}",
            started_time=now,
            op_id=f"{rem.id}.op",  # providers.router.op_remediation reads it back
            executor=self.replica,
            claim_time=now,
            boot_id_before=health.value.boot_id if health else "",
            host_before=host,
            interrupted=idle.interrupt,
        )
        written = await self.store.write(current, started)
        if written is None:
            return
        if idle.interrupt and held is not None:  # R16 after the max wait; R17 at once
            lease = held.value
            reason = FAULT_BROKE_MEMBER if rem.breaks_workload else NODE_REPAIR
            message = (
                f"{rem.node} is being repaired (remediation {rem.id}); epoch {lease.epoch} "
                "ends and the gang is placed again without it"
            )
            await restart_gang(self.store.bus, rem.node, lease.gang, lease.epoch, reason, message)
        await self._run(written, now)

    async def _admitted(self, current: Versioned[Remediation], now: datetime) -> bool:
        """R13 before a repair starts: the node's cooldown, the provider's capacity, one repair
        at a time per pool and the cluster's budget (both slots taken, or neither). What holds
        it back is its reason."""
        rem = current.value
        until = guardrails.cooldown_until(self._last_repair(rem), self.settings)
        if until is not None and now < until:
            await self._wait(
                current,
                "cooldown",
                f"cooldown after the last repair of {rem.node} until {until:%Y-%m-%dT%H:%M:%S}Z",
            )
            return False
        if not await self.provider.has_capacity(rem.node, rem.action):
            await self._wait(current, "capacity", f"no capacity for {rem.action.value} now")
            return False
        limit = guardrails.budget(self.store.cluster_size(rem.cluster), self.settings)
        if not await self.slots.take(f"pool.{rem.pool}", rem.id, 1, now):
            await self._wait(
                current, "pool", f"another repair runs in node pool {rem.pool} (one at a time)"
            )
            return False
        if not await self.slots.take(f"cluster.{rem.cluster}", rem.id, limit, now):
            await self.slots.release(f"pool.{rem.pool}", rem.id)
            await self._wait(
                current,
                "budget",
                f"the concurrency budget of cluster {rem.cluster} ({limit} at once) is spent",
            )
            return False
        return True

    def _last_repair(self, rem: Remediation) -> datetime | None:
        """When the node's last other repair that ran (done or failed) finished."""
        last: datetime | None = None
        for other_id in self.store.rems_of.get(rem.node, set()):
            other = self.store.rems.get(other_id)
            if other is None or other.key == rem.id or other.value.finished_time is None:
                continue
            if other.value.outcome in (Outcome.DONE, Outcome.FAILED):
                if last is None or other.value.finished_time > last:
                    last = other.value.finished_time
        return last

    async def _wait(self, current: Versioned[Remediation], guardrail: str, reason: str) -> None:
        if current.value.reason == reason:
            return
        metrics.GUARDRAIL_WAITS.labels(guardrail).inc()
        await self.store.write(current, msgspec.structs.replace(current.value, reason=reason))

    async def _finish(
        self,
        current: Versioned[Remediation],
        outcome: Outcome,
        now: datetime,
        reason: str,
        **changes: object,
    ) -> None:
        finished = lifecycle.finish(current.value, outcome, now, self.replica, reason, **changes)
        await self.store.write(current, finished)

    async def _run(self, current: Versioned[Remediation], now: datetime) -> None:
        health = self.store.health.get(current.value.node)
        boot_id = health.value.boot_id if health else ""
        if current.value.issued_time is None:
            await self._issue(current, boot_id, now)
        else:
            await self._watch_return(current, boot_id, now)

    async def _claim(
        self, current: Versioned[Remediation], now: datetime
    ) -> Versioned[Remediation] | None:
        """The replica that started the repair issues its action; another one takes it over
        once that claim is older than the grace (its replica stopped). None: not ours."""
        rem = current.value
        if rem.executor == self.replica:
            return current
        if rem.claim_time is not None and now - rem.claim_time <= self.settings.claim_grace:
            return None  # the replica that claimed it issues it
        return await self.store.write(
            current, msgspec.structs.replace(rem, executor=self.replica, claim_time=now)
        )

    async def _issue(self, current: Versioned[Remediation], boot_id: str, now: datetime) -> None:
        """Once (R12, R14): not when the provider carried it out already, nor a reboot or
        power cycle of a host that came back by itself."""
        claimed = await self._claim(current, now)
        if claimed is None:
            return
        current, rem = claimed, claimed.value
        executed = await self.provider.executed(rem.node, rem.op_id)
        decision, why = lifecycle.issue_decision(rem, boot_id, executed)
        answer: str | None = None
        if decision == "issue":
            try:
                answer = await self.provider.execute(rem.node, rem.action, rem.op_id)
            except ProviderError as error:  # the provider's reason, as the operator reads it
                if error.permanent or lifecycle.timed_out(rem, now, self.settings.action_timeout):
                    await self._finish(
                        current,
                        Outcome.FAILED,
                        now,
                        f"{rem.action.value} could not be carried out: {error.reason}",
                        provider_answer=error.reason,
                    )
                else:
                    await self._wait(current, "provider", f"{rem.action.value}: {error.reason}")
                return
            except Exception as error:  # retried on the next tick, up to the timeout
                if lifecycle.timed_out(rem, now, self.settings.action_timeout):
                    await self._finish(
                        current,
                        Outcome.FAILED,
                        now,
                        f"{rem.action.value} could not be carried out: {error}",
                    )
                else:
                    await self._wait(current, "provider", f"{rem.action.value}: {error}")
                return
            reason = f"{rem.action.value} issued; waiting for {rem.node} to come back"
        else:
            reason = f"{rem.action.value} not issued again: {why}"
        await self.store.write(
            current,
            msgspec.structs.replace(
                rem,
                issued_time=self.clock(),
                issue_skipped=why,
                reason=reason,
                provider_answer=answer or rem.provider_answer,
            ),
        )

    async def _watch_return(
        self, current: Versioned[Remediation], boot_id: str, now: datetime
    ) -> None:
        """Issued: the machine comes back (to revalidation) or the action times out."""
        rem = current.value
        host, retired = await self.provider.host(rem.node)
        if lifecycle.came_back(rem, boot_id, host, retired):
            await self.store.write(
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
            await self._finish(
                current,
                Outcome.FAILED,
                now,
                f"{rem.node} did not come back within {self.settings.action_timeout}",
            )

    async def _revalidate(self, current: Versioned[Remediation], now: datetime) -> None:
        rem = current.value
        if rem.action is Action.DELETE:
            await self.cordons.hold_forever(rem, now)
            await self._finish(
                current, Outcome.DONE, now, "retired; its host went straight to revalidation (R15)"
            )
            return
        failures = await self.provider.diagnose(rem.node)
        if failures:
            await self._finish(
                current,
                Outcome.FAILED,
                now,
                "diagnostics failed: the node stays out of service",
                diagnostics=failures,
            )
        else:
            await self._finish(
                current, Outcome.DONE, now, "diagnostics passed: the node rejoins", diagnostics=[]
            )

    async def settle(self, rid: str, now: datetime) -> None:
        """After the end: slots released, the ladder and the alert told, the cordon lifted when
        the node is healthy. Each step is idempotent; `settled` records that all ran."""
        current = self.store.rems[rid]
        rem = current.value
        for scope in (f"node.{rem.node}", f"pool.{rem.pool}", f"cluster.{rem.cluster}"):
            await self.slots.release(scope, rid)
        if rem.ladder_key and rem.outcome is not None and rem.started_time is not None:
            attempt = LadderAttempt(
                remediation_id=rid,
                action=rem.requested_action,
                time=rem.started_time,
                outcome=rem.outcome,
            )
            await self.store.mutate(
                self.store.ladder_bucket,
                self.store.ladders,
                rem.ladder_key,
                lambda lad: ladder.record(
                    lad, rem.ladder_key, rem.node, rem.cluster, rem.kind, rem.xid, attempt, now
                ),
            )
        if rem.outcome in (Outcome.DONE, Outcome.FAILED):
            for aid in rem.alert_ids:
                await self.store.mutate(
                    self.store.alert_bucket,
                    self.store.alerts,
                    aid,
                    lambda a: alert_rules.after_repair(a, rem.generation, now) if a else None,
                )
        if rem.outcome is not Outcome.FAILED:
            await self.cordons.lift(rem.node)
        if rem.outcome is not None:
            metrics.REMEDIATIONS.labels(rem.action.value, rem.outcome.value).inc()
        await self.store.write(current, msgspec.structs.replace(rem, settled=True), event=False)

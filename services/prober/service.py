"""The central prober and the gang's run (G10-G12, G17): when an epoch is placed it probes every
pair in rounds through the members' agents, publishes the slowest pair and NetworkQualified,
launches the ranks, watches them to the end, and bills boot time, run time and relay bytes.
A failed probe sends the gang back to placement without the failing machine (not billed);
ShimNotLoaded fails the Job at once (billed)."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from datetime import datetime
from typing import TypeVar

import msgspec
from prometheus_client import Counter, Histogram

from libs.bus import Bus
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.epochs import Epoch
from libs.contracts.errors import NodusError
from libs.contracts.jobs import (
    Billing,
    ConditionType,
    Job,
    JobStatus,
    PathClass,
    Phase,
    Probe,
    with_condition,
)
from libs.contracts.lifecycle import (
    LaunchReply,
    LaunchRequest,
    PairResult,
    ProbePairRequest,
    ProbeRecord,
    ProbeServeReply,
    ProbeServeRequest,
    RankStatus,
    ShimCheckReply,
    ShimCheckRequest,
    StopRequest,
)
from libs.contracts.relay import Member, UsageRecord
from libs.runtime.tasks import cancel_and_wait
from services.prober.schedule import rounds

log = logging.getLogger("nodus.prober")
R = TypeVar("R", bound=msgspec.Struct)

MAX_EPOCHS = 5  # epochs a gang may fail its probe in before the Job fails
USAGE_SETTLE_SECONDS = 2.5  # > the relays' usage flush interval (1 s) plus delivery

PROBES = Counter("nodus_prober_probes_total", "Epoch probes by outcome", ["outcome"])
PROBE_SECONDS = Histogram(
    "nodus_prober_probe_seconds",
    "Wall time of one epoch's probe",
    buckets=(1, 2, 5, 10, 20, 40, 80, 160, 320),
)
RUNS = Counter("nodus_prober_runs_total", "Gang runs by outcome", ["outcome"])


class Prober:
    def __init__(
        self,
        bus: Bus,
        replica: str | None = None,
        sample_seconds: float = 10.0,
        readiness_seconds: float = 60.0,
    ) -> None:
        self.bus = bus
        self.replica = replica or f"prober-{secrets.token_hex(3)}"
        self.sample_seconds = sample_seconds
        self.readiness_seconds = readiness_seconds
        self.jobs = bus.bucket(names.BUCKET_JOBS, Job)
        self.epochs = bus.bucket(names.BUCKET_EPOCHS, Epoch)
        self.members = bus.bucket(names.BUCKET_MEMBERS, Member)
        self.probes = bus.bucket(names.BUCKET_PROBES, ProbeRecord)
        self.ranks = bus.bucket(names.BUCKET_RANKS, RankStatus)
        self._active: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._concluding: set[asyncio.Task[None]] = set()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._watch_jobs()),
            asyncio.create_task(self._watch_ranks()),
        ]
        log.info("prober %s ready", self.replica)

    async def stop(self) -> None:
        await cancel_and_wait([*self._tasks, *self._active.values(), *self._concluding])

    # -- watching ------------------------------------------------------------------------------

    async def _watch_jobs(self) -> None:
        async for change in self.jobs.watch():
            job = change.value
            if job is None or job.status.phase is not Phase.PLACED:
                continue
            key = (job.key, job.status.epoch)
            if key in self._active:
                continue
            task = asyncio.create_task(self._qualify(*key))
            self._active[key] = task
            task.add_done_callback(lambda _, k=key: self._active.pop(k, None))  # type: ignore[misc]

    async def _watch_ranks(self) -> None:
        async for change in self.ranks.watch():
            status = change.value
            if status is not None and status.state != "Running":
                # One task per exit: a check that runs while another rank exits must not be
                # the last one (the job's compare-and-set lets one of them conclude).
                task = asyncio.create_task(self._conclude_logged(status.gang, status.epoch))
                self._concluding.add(task)
                task.add_done_callback(self._concluding.discard)

    async def _conclude_logged(self, gang: str, epoch: int) -> None:
        try:
            await self._conclude(gang, epoch)
        except Exception:
            log.exception("concluding %s epoch %d", gang, epoch)

    # -- the probe -----------------------------------------------------------------------------

    async def _qualify(self, gang: str, epoch_number: int) -> None:
        started = asyncio.get_running_loop().time()
        stored = await self.epochs.get(names.epoch_key(gang, epoch_number))
        if stored is None:
            return
        epoch = stored.value
        nodes = [m.node for m in sorted(epoch.members, key=lambda m: m.rank)]
        schedule = rounds(nodes)
        record = ProbeRecord(
            gang=gang,
            epoch=epoch_number,
            state="Running",
            prober=self.replica,
            started_time=now(),
            rounds=len(schedule),
        )
        if await self.probes.create(names.epoch_key(gang, epoch_number), record) is None:
            return  # another replica runs it
        if not await self._update_job(
            gang, epoch_number, lambda s: _phase(s, Phase.PROBING), {Phase.PLACED}
        ):
            return
        await self._wait_joined(gang, epoch_number, nodes)
        if epoch.path is PathClass.RELAYED:
            refusal = await self._shim_checks(gang, epoch_number, nodes)
            if refusal is not None:
                await self._shim_not_loaded(gang, epoch_number, refusal)
                return
        results: list[PairResult] = []
        for pairs in schedule:
            outcome = await asyncio.gather(
                *(self._pair(gang, epoch_number, a, b) for a, b in pairs)
            )
            results.extend(outcome)
            await self.probes.mutate(
                names.epoch_key(gang, epoch_number), _with_pairs(list(results))
            )
        PROBE_SECONDS.observe(asyncio.get_running_loop().time() - started)
        failed = [r for r in results if not r.ok]
        wanted = {"Direct": {"direct"}, "Auto": {"direct", "derp"}}
        job = await self.jobs.get(gang)
        transport = job.value.spec.distributed.transport if job else "Auto"
        worse = [r for r in results if r.ok and r.path.split(":")[0] not in wanted[transport]]
        if failed or worse:
            await self._probe_failed(
                gang, epoch_number, (failed or worse)[0], results, bool(failed)
            )
            return
        await self._qualified(gang, epoch_number, nodes, results)

    async def _wait_joined(self, gang: str, epoch: int, nodes: list[str]) -> None:
        """Members record their WireGuard key when they join; give them the readiness window."""
        joined: set[str] = set()

        async def watch() -> None:
            async for change in self.members.watch(f"{gang}.{epoch}.*"):
                if change.value is not None:
                    joined.add(change.value.node)
                    if joined >= set(nodes):
                        return

        try:
            await asyncio.wait_for(watch(), self.readiness_seconds)
        except TimeoutError:
            log.warning("%s epoch %d: %s never joined", gang, epoch, sorted(set(nodes) - joined))

    async def _shim_checks(self, gang: str, epoch: int, nodes: list[str]) -> str | None:
        replies = await asyncio.gather(
            *(
                self.bus.request(
                    names.node_request(n, "shim-check"),
                    ShimCheckRequest(gang=gang, epoch=epoch),
                    ShimCheckReply,
                    timeout=60,
                )
                for n in nodes
            ),
            return_exceptions=True,
        )
        for node, reply in zip(nodes, replies, strict=True):
            if isinstance(reply, BaseException):
                return f"{node}: the shim self-test did not run: {reply}"
            if not reply.ok:
                return f"{node}: {reply.error}"
        return None

    async def _pair(self, gang: str, epoch: int, a: str, b: str) -> PairResult:
        """a measures a->b through the workload's path; b opens its own fresh connections back.
        A failure names its suspect: the member that could not serve, or could not be reached."""
        serve = ProbeServeRequest(gang=gang, epoch=epoch)
        ends: dict[str, ProbeServeReply] = {}
        for node in (b, a):
            try:
                ends[node] = await self._request(node, "probe-serve", serve, ProbeServeReply)
            except NodusError as error:
                return PairResult(
                    a=a,
                    b=b,
                    ok=False,
                    error=f"{node} cannot serve probes: {error}",
                    suspect=node,
                    measured_time=now(),
                )
        timeout = self.readiness_seconds + self.sample_seconds + 45
        forward, reverse = await asyncio.gather(
            self._request(
                a,
                "probe-pair",
                ProbePairRequest(
                    gang=gang,
                    epoch=epoch,
                    peer=b,
                    address=ends[b].address,
                    port=ends[b].port,
                    sample_seconds=self.sample_seconds,
                    readiness_seconds=self.readiness_seconds,
                ),
                PairResult,
                timeout,
            ),
            self._request(
                b,
                "probe-pair",
                ProbePairRequest(
                    gang=gang,
                    epoch=epoch,
                    peer=a,
                    address=ends[a].address,
                    port=ends[a].port,
                    readiness_seconds=self.readiness_seconds,
                    measure=False,
                ),
                PairResult,
                timeout,
            ),
            return_exceptions=True,
        )
        if isinstance(forward, BaseException) or not forward.ok:
            why = forward if isinstance(forward, BaseException) else forward.error
            return PairResult(
                a=a, b=b, ok=False, error=f"{a} -> {b}: {why}", suspect=b, measured_time=now()
            )
        if isinstance(reverse, BaseException) or not reverse.ok:
            why = reverse if isinstance(reverse, BaseException) else reverse.error
            return msgspec.structs.replace(forward, ok=False, error=f"{b} -> {a}: {why}", suspect=a)
        return msgspec.structs.replace(
            forward, connections=forward.connections + reverse.connections
        )

    async def _request(
        self, node: str, verb: str, body: msgspec.Struct, reply: type[R], timeout: float = 10.0
    ) -> R:
        return await self.bus.request(names.node_request(node, verb), body, reply, timeout)

    # -- outcomes ------------------------------------------------------------------------------

    async def _qualified(
        self, gang: str, epoch: int, nodes: list[str], results: list[PairResult]
    ) -> None:
        slowest = min(results, key=lambda r: r.tcp_gbps)
        t = now()
        await self.probes.mutate(
            names.epoch_key(gang, epoch),
            lambda r: msgspec.structs.replace(r, state="Qualified", finished_time=t) if r else None,
        )
        probe = Probe(
            tcp_gbps=slowest.tcp_gbps,
            rtt_ms=max(r.rtt_ms for r in results),
            path=slowest.path,
            measured_time=slowest.measured_time or t,
        )

        def qualified(status: JobStatus) -> JobStatus:
            gang_status = msgspec.structs.replace(status.gang, probe=probe) if status.gang else None
            status = msgspec.structs.replace(status, gang=gang_status)
            return with_condition(
                status,
                ConditionType.NETWORK_QUALIFIED,
                "True",
                "ProbePassed",
                f"{len(results)} pairs measured; slowest {slowest.a}-{slowest.b}: {slowest.tcp_gbps:g} Gbit/s, "
                f"{slowest.rtt_ms:g} ms, {slowest.path}",
                t,
            )

        if not await self._update_job(gang, epoch, qualified, {Phase.PROBING}):
            return
        PROBES.labels("qualified").inc()
        job = await self.jobs.get(gang)
        if job is None:
            return
        stored = await self.epochs.get(names.epoch_key(gang, epoch))
        assert stored is not None
        launches = await asyncio.gather(
            *(
                self._request(
                    m.node,
                    "launch",
                    LaunchRequest(gang=gang, epoch=epoch, rank=m.rank),
                    LaunchReply,
                    30,
                )
                for m in stored.value.members
            ),
            return_exceptions=True,
        )
        failed = [
            (m.node, r)
            for m, r in zip(stored.value.members, launches, strict=True)
            if isinstance(r, BaseException)
        ]
        started = now()

        def running(status: JobStatus) -> JobStatus:
            boot = (started - (status.placed_time or started)).total_seconds()
            return msgspec.structs.replace(
                status,
                phase=Phase.RUNNING,
                run_started_time=started,
                billing=Billing(boot_seconds=round(boot, 3)),
            )

        await self._update_job(gang, epoch, running, {Phase.PROBING})
        if failed:
            node, error = failed[0]
            await self._finish(gang, epoch, False, "LaunchFailed", f"{node}: {error}")

    async def _probe_failed(
        self, gang: str, epoch: int, pair: PairResult, results: list[PairResult], unreachable: bool
    ) -> None:
        """G12: the epoch fails and the gang is placed again without the failing machine;
        the failed epoch's time is not billed."""
        t = now()
        reason = f"pair {pair.a}-{pair.b}: " + (
            pair.error or f"path {pair.path} is worse than the transport allows"
        )
        await self.probes.mutate(
            names.epoch_key(gang, epoch),
            lambda r: (
                msgspec.structs.replace(r, state="Failed", finished_time=t, reason=reason)
                if r
                else None
            ),
        )
        PROBES.labels("failed").inc()

        stored = await self.epochs.get(names.epoch_key(gang, epoch))
        job = await self.jobs.get(gang)
        direct_failed = (
            stored is not None
            and stored.value.path is PathClass.DIRECT
            and job is not None
            and job.value.spec.distributed.transport == "Auto"
        )

        history: list[str] = []
        if epoch >= MAX_EPOCHS:
            for number in range(1, epoch + 1):
                record = await self.probes.get(names.epoch_key(gang, number))
                if record is not None and record.value.state == "Failed":
                    history.append(f"epoch {number}: {record.value.reason}")

        def again(status: JobStatus) -> JobStatus:
            if history:
                # A gang that cannot be qualified after a bounded number of epochs fails,
                # with every epoch's reason (the failed epochs were not billed).
                status = with_condition(
                    status,
                    ConditionType.GANG_READY,
                    "False",
                    "EpochsExhausted",
                    f"no qualified placement after {epoch} epochs: " + "; ".join(history),
                    t,
                )
                return msgspec.structs.replace(status, phase=Phase.FAILED, finished_time=t)
            if direct_failed:
                # G12: an Auto gang whose direct path fails continues as Relayed, same machines.
                status = with_condition(
                    status,
                    ConditionType.NETWORK_QUALIFIED,
                    "False",
                    "DirectPathFailed",
                    f"{reason}; continuing as Relayed",
                    t,
                )
                return msgspec.structs.replace(
                    status, phase=Phase.PENDING, path_override=PathClass.RELAYED
                )
            status = with_condition(
                status, ConditionType.NETWORK_QUALIFIED, "False", "ProbeFailed", reason, t
            )
            return msgspec.structs.replace(
                status, phase=Phase.PENDING, avoid=[*status.avoid, pair.suspect or pair.b]
            )

        await self._update_job(gang, epoch, again, {Phase.PROBING})
        log.warning(
            "%s epoch %d failed its probe (%s); placing it again without %s",
            gang,
            epoch,
            reason,
            pair.suspect or pair.b,
        )

    async def _shim_not_loaded(self, gang: str, epoch: int, why: str) -> None:
        t = now()
        await self.probes.mutate(
            names.epoch_key(gang, epoch),
            lambda r: (
                msgspec.structs.replace(r, state="Failed", finished_time=t, reason=why)
                if r
                else None
            ),
        )
        PROBES.labels("shim_not_loaded").inc()

        def failed(status: JobStatus) -> JobStatus:
            boot = (t - (status.placed_time or t)).total_seconds()
            status = with_condition(
                status, ConditionType.NETWORK_QUALIFIED, "False", "ShimNotLoaded", why, t
            )
            return msgspec.structs.replace(
                status,
                phase=Phase.FAILED,
                finished_time=t,
                billing=Billing(boot_seconds=round(boot, 3)),
            )

        await self._update_job(gang, epoch, failed, {Phase.PROBING})

    # -- the run -------------------------------------------------------------------------------

    async def _conclude(self, gang: str, epoch: int) -> None:
        job = await self.jobs.get(gang)
        if (
            job is None
            or job.value.status.epoch != epoch
            or job.value.status.phase is not Phase.RUNNING
        ):
            return
        stored = await self.epochs.get(names.epoch_key(gang, epoch))
        if stored is None:
            return
        found = await asyncio.gather(
            *(self.ranks.get(names.rank_key(gang, epoch, m.rank)) for m in stored.value.members)
        )
        statuses = {f.key: f for f in found if f is not None}
        members = {m.rank: m.node for m in stored.value.members}
        # A rank the platform stopped (fencing, a machine going away) is not the workload
        # failing: the gang is re-placed by the member-loss path instead.
        failed = [
            s.value for s in statuses.values() if s.value.state == "Exited" and s.value.exit_code
        ]
        if failed:
            first = min(failed, key=lambda s: s.ended_time or now())
            await self._finish(
                gang,
                epoch,
                False,
                "RankFailed",
                f"rank {first.rank} on {first.node} exited with code {first.exit_code}",
            )
            return
        done = [
            s for s in statuses.values() if s.value.state == "Exited" and s.value.exit_code == 0
        ]
        if len(done) == len(members):
            await self._finish(gang, epoch, True, "Completed", f"all {len(members)} ranks exited 0")

    async def _finish(
        self, gang: str, epoch: int, succeeded: bool, reason: str, message: str
    ) -> None:
        t = now()
        # Relays publish what members sent once a second: wait for the last flush of the run.
        await asyncio.sleep(USAGE_SETTLE_SECONDS)
        relay_bytes = await self._relay_bytes(gang)

        def finished(status: JobStatus) -> JobStatus:
            run = (t - (status.run_started_time or t)).total_seconds()
            boot = status.billing.boot_seconds if status.billing else 0.0
            status = msgspec.structs.replace(
                status,
                phase=Phase.SUCCEEDED if succeeded else Phase.FAILED,
                finished_time=t,
                billing=Billing(
                    boot_seconds=boot,
                    run_seconds=round(run, 3),
                    mesh_relay_gi_b=relay_bytes / 2**30,
                ),
            )
            return with_condition(status, ConditionType.GANG_READY, "False", reason, message, t)

        if await self._update_job(gang, epoch, finished, {Phase.RUNNING}):
            RUNS.labels("succeeded" if succeeded else "failed").inc()
            log.info(
                "%s epoch %d %s: %s", gang, epoch, "succeeded" if succeeded else "failed", message
            )
            if not succeeded:
                stored = await self.epochs.get(names.epoch_key(gang, epoch))
                for member in stored.value.members if stored else []:
                    try:
                        await self._request(
                            member.node,
                            "stop",
                            StopRequest(gang=gang, epoch=epoch),
                            LaunchReply,
                            15,
                        )
                    except NodusError as error:
                        log.warning("stopping %s on %s: %s", gang, member.node, error)

    async def _relay_bytes(self, gang: str) -> int:
        total = 0
        sub = await self.bus.js.subscribe(f"nodus.usage.*.{gang}", ordered_consumer=True)
        try:
            while True:
                try:
                    msg = await sub.next_msg(timeout=0.3)
                except Exception:  # nothing more
                    break
                try:
                    total += msgspec.json.decode(msg.data, type=UsageRecord).bytes_sent
                except msgspec.ValidationError:
                    continue
                if msg.metadata.num_pending == 0:
                    break
        finally:
            await sub.unsubscribe()
        return total

    async def _update_job(
        self, gang: str, epoch: int, change: Callable[[JobStatus], JobStatus], phases: set[Phase]
    ) -> bool:
        """Compare-and-set on the job: only while it is still this epoch, in one of `phases`."""
        applied = [False]

        def update(job: Job | None) -> Job | None:
            if job is None or job.status.epoch != epoch or job.status.phase not in phases:
                return None
            applied[0] = True
            return msgspec.structs.replace(job, status=change(job.status))

        result = await self.jobs.mutate(gang, update)
        return result is not None and applied[0]


def _phase(status: JobStatus, phase: Phase) -> JobStatus:
    return msgspec.structs.replace(status, phase=phase)


def _age(since: datetime | None, t: datetime) -> float:
    return (t - since).total_seconds() if since else 0.0


def _with_pairs(done: list[PairResult]) -> Callable[[ProbeRecord | None], ProbeRecord | None]:
    def change(record: ProbeRecord | None) -> ProbeRecord | None:
        return msgspec.structs.replace(record, pairs=done) if record else None

    return change

"""The central runner (G10-G12): when an epoch is placed it probes every pair in rounds through
the members' agents, publishes the slowest pair and NetworkQualified, and hands the qualified
epoch to the gang's run (`run.py`: launch, conclude, bill). A failed probe sends the gang back
to placement (not billed); ShimNotLoaded fails the Job at once (billed)."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from datetime import datetime
from typing import Literal, TypeVar

import msgspec
import nats.errors

from libs.bus import Bus
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.bounds import (
    HEARTBEAT_TIMEOUT_SECONDS,
    HEARTBEATS_PER_TIMEOUT,
    SHIM_SELF_TEST_SECONDS,
)
from libs.contracts.epochs import Epoch
from libs.contracts.errors import NodusError
from libs.contracts.jobs import (
    Job,
    JobStatus,
    PathClass,
    Phase,
    Probe,
)
from libs.contracts.lifecycle import (
    PairResult,
    ProbePairRequest,
    ProbeRecord,
    ProbeServeReply,
    ProbeServeRequest,
    ShimCheckReply,
    ShimCheckRequest,
)
from libs.contracts.relay import Member
from libs.jobs import lifecycle
from libs.jobs.store import advance, publish_recent_events, restart_gang
from libs.runtime.tasks import TaskSet
from services.runner.agents import MemberSilent, RequestLost, ask, instances, unless_lost
from services.runner.metrics import PROBE_SECONDS, PROBES, TAKEOVERS, record_pairs
from services.runner.run import GangRun
from services.runner.schedule import rounds

JOIN_POLL_SECONDS = 0.2  # a member's join record read again

log = logging.getLogger("nodus.runner")
R = TypeVar("R", bound=msgspec.Struct)

MAX_EPOCHS = 5  # epochs a gang may fail its probe in before the Job fails
PAIR_TRIES = 3  # a pair measured again after a request of it was lost
# A pair whose agent answers nothing this long when it begins fails (the gang is placed again
# without it) rather than wait a member's whole patience: an agent restarting is back sooner.
PAIR_START_UNANSWERED_SECONDS = 5.0
# A shim check is asked again when its answer is this late (the self-test's own limit, and a
# margin): a request a bus server lost on the way was waited 60 s.
SHIM_ANSWER_SECONDS = SHIM_SELF_TEST_SECONDS + 5.0


class Runner:
    def __init__(
        self,
        bus: Bus,
        replica: str | None = None,
        sample_seconds: float = 10.0,
        readiness_seconds: float = 60.0,
        takeover_seconds: float = HEARTBEAT_TIMEOUT_SECONDS,
    ) -> None:
        self.bus = bus
        self.replica = replica or f"runner-{secrets.token_hex(3)}"
        self.sample_seconds = sample_seconds
        self.readiness_seconds = readiness_seconds
        self.jobs = bus.bucket(names.BUCKET_JOBS, Job)
        self.epochs = bus.bucket(names.BUCKET_EPOCHS, Epoch)
        self.members = bus.bucket(names.BUCKET_MEMBERS, Member)
        self.probes = bus.bucket(names.BUCKET_PROBES, ProbeRecord)
        self.run = GangRun(bus)
        self.instance = secrets.token_hex(4)  # this process, in the probe records it holds
        self.takeover_seconds = takeover_seconds
        self.beat_seconds = takeover_seconds / HEARTBEATS_PER_TIMEOUT
        self.tasks = TaskSet("runner", log)
        self._active: dict[tuple[str, int], asyncio.Task[None]] = {}  # epochs probed here
        self._open: dict[str, int] = {}  # Placed or Probing jobs -> their epoch

    async def start(self) -> None:
        await self.run.start()
        caught_up = asyncio.Event()
        self.tasks.spawn(self._watch_jobs(caught_up), name="watch-jobs")
        self.tasks.spawn(self._sweep(caught_up), name="takeover-sweep")
        self.tasks.spawn(publish_recent_events(self.bus), name="recent events")
        log.info("runner %s ready", self.replica)

    async def stop(self, release: bool = True) -> None:
        """Stop; what it was probing is released to the other replicas (`release=False`: as
        a process that died would leave it, for the takeover tests)."""
        held = list(self._active) if release else []
        await self.tasks.close()
        await self.run.stop()
        for gang, epoch in held:
            await self._release(gang, epoch)

    async def _release(self, gang: str, epoch: int) -> None:
        """A probe this replica stops holding mid-way is offered to the others at once."""

        def release(record: ProbeRecord) -> ProbeRecord:
            return msgspec.structs.replace(record, released=True)

        guarded = self._held(release)
        try:
            released = await self.probes.mutate(
                names.epoch_key(gang, epoch),
                lambda r: guarded(r) if r is not None and r.state == "Running" else None,
            )
        except (NodusError, nats.errors.Error, OSError, TimeoutError) as error:
            log.info("%s epoch %d: probe not released (it ages out): %s", gang, epoch, error)
            return
        if released is not None:
            log.info("%s epoch %d: probe released for another replica", gang, epoch)

    # -- watching ------------------------------------------------------------------------------

    async def _watch_jobs(self, caught_up: asyncio.Event) -> None:
        async for change in self.jobs.watch(caught_up=caught_up):
            job = change.value
            if job is None or job.status.phase not in lifecycle.AWAITS_PROBE:
                self._open.pop(change.key, None)
                continue
            self._open[job.key] = job.status.epoch
            if job.status.phase is Phase.PLACED:
                self._probe(job.key, job.status.epoch)

    async def _sweep(self, caught_up: asyncio.Event) -> None:
        """Takeover: once the jobs are known, and on every beat after, each Placed or Probing
        epoch that no task here probes is offered to `_claim`, which takes it over when its
        holder is silent or restarted. The first pass is a replica's start."""
        await caught_up.wait()
        while True:
            for gang, epoch in list(self._open.items()):
                self._probe(gang, epoch)
            await asyncio.sleep(self.beat_seconds)

    def _probe(self, gang: str, epoch: int) -> None:
        key = (gang, epoch)
        if key in self._active:
            return
        task = self.tasks.spawn(self._qualify(gang, epoch), name=f"probe {gang}.{epoch}")
        self._active[key] = task
        task.add_done_callback(lambda _: self._active.pop(key, None))

    # -- holding an epoch's probe --------------------------------------------------------------

    async def _claim(self, gang: str, epoch: int, rounds: int) -> bool:
        """Create the epoch's probe record, or take it over from a holder that is silent or
        restarted; compare-and-set on the record's revision, so one replica wins."""
        job = await self.jobs.get(gang)
        if (
            job is None
            or job.value.status.epoch != epoch
            or job.value.status.phase not in lifecycle.AWAITS_PROBE
        ):
            return False
        key = names.epoch_key(gang, epoch)
        t = now()
        mine = ProbeRecord(
            gang=gang,
            epoch=epoch,
            state="Running",
            prober=self.replica,
            instance=self.instance,
            started_time=t,
            heartbeat_time=t,
            rounds=rounds,
        )
        current = await self.probes.get(key)
        if current is None:
            return await self.probes.create(key, mine) is not None
        held = current.value
        if held.prober == self.replica and held.instance != self.instance:
            why = "its previous run"
        elif held.released:
            why = "it stopped and released it"
        else:
            silent = (t - (held.heartbeat_time or held.started_time)).total_seconds()
            if silent <= self.takeover_seconds:
                return False  # its holder is alive (or this task's own, ended, waits its turn)
            why = f"silent for {silent:.1f} s"
        taken = msgspec.structs.replace(mine, attempt=held.attempt + 1)
        if await self.probes.update(key, taken, current.revision) is None:
            return False  # another replica took it first, or the holder beat just now
        TAKEOVERS.inc()
        log.warning(
            "%s epoch %d: took the probe over from %s (%s); probing again from the start "
            "(attempt %d)",
            gang,
            epoch,
            held.prober,
            why,
            taken.attempt,
        )
        return True

    def _held(
        self, change: Callable[[ProbeRecord], ProbeRecord]
    ) -> Callable[[ProbeRecord | None], ProbeRecord | None]:
        """A change to the probe record only while this process holds it."""

        def guarded(record: ProbeRecord | None) -> ProbeRecord | None:
            if record is None or (record.prober, record.instance) != (self.replica, self.instance):
                return None
            return change(record)

        return guarded

    async def _hold(self, gang: str, epoch: int, holder: asyncio.Task[None]) -> None:
        """Renew the heartbeat while `holder` probes and launches; a record taken over by
        another replica stops it."""
        key = names.epoch_key(gang, epoch)
        while True:
            await asyncio.sleep(self.beat_seconds)
            try:
                beat = await self.probes.mutate(
                    key, self._held(lambda r: msgspec.structs.replace(r, heartbeat_time=now()))
                )
            except (NodusError, nats.errors.Error) as error:  # the bus reconnects; beat again
                log.warning("%s epoch %d: heartbeat not written: %s", gang, epoch, error)
                continue
            if beat is None:
                log.warning("%s epoch %d: another runner took the probe over", gang, epoch)
                holder.cancel()
                return

    # -- the probe -----------------------------------------------------------------------------

    async def _qualify(self, gang: str, epoch_number: int) -> None:
        stored = await self.epochs.get(names.epoch_key(gang, epoch_number))
        if stored is None:
            return
        nodes = [m.node for m in sorted(stored.value.members, key=lambda m: m.rank)]
        if not await self._claim(gang, epoch_number, len(rounds(nodes))):
            return
        holder = asyncio.current_task()
        assert holder is not None
        beat = self.tasks.spawn(self._hold(gang, epoch_number, holder), name="heartbeat")
        try:
            await self._probe_epoch(gang, stored.value, nodes)
        finally:
            beat.cancel()

    async def _probe_epoch(self, gang: str, epoch: Epoch, nodes: list[str]) -> None:
        started = asyncio.get_running_loop().time()
        epoch_number = epoch.epoch
        schedule = rounds(nodes)
        if not await advance(self.bus, gang, epoch_number, lifecycle.PROBING, lifecycle.probing):
            return
        await self._wait_joined(gang, epoch_number, nodes)
        # Each step said as it starts: a probe that stalls shows where (chaos: a Relayed probe
        # silent for 70 s left nothing to read of which request it waited on).
        log.info("%s epoch %d: probing %s", gang, epoch_number, ", ".join(nodes))
        if epoch.path is PathClass.RELAYED:
            try:
                refusal = await self._shim_checks(gang, epoch_number, nodes)
            except MemberSilent as silent:
                await self._member_silent(gang, epoch_number, silent)
                return
            if refusal is not None:
                await self._shim_not_loaded(gang, epoch_number, refusal)
                return
        results: list[PairResult] = []
        for number, pairs in enumerate(schedule, 1):
            log.info(
                "%s epoch %d: round %d of %d: %s",
                gang,
                epoch_number,
                number,
                len(schedule),
                ", ".join(f"{a}-{b}" for a, b in pairs),
            )
            outcome = await asyncio.gather(
                *(self._pair(gang, epoch_number, a, b) for a, b in pairs),
                return_exceptions=True,
            )
            for measured in outcome:
                if isinstance(measured, MemberSilent):
                    await self._member_silent(gang, epoch_number, measured)
                    return
                if isinstance(measured, BaseException):
                    raise measured
                results.append(measured)
            await self.probes.mutate(
                names.epoch_key(gang, epoch_number), self._held(_with_pairs(list(results)))
            )
        PROBE_SECONDS.observe(asyncio.get_running_loop().time() - started)
        failed = [r for r in results if not r.ok]
        # G12: on a Direct epoch every pair must go peer to peer (a pair the relays carry
        # from the start re-places a Direct gang, and an Auto one continues as Relayed); a
        # Relayed epoch is what Auto allows.
        wanted = {"direct"} if epoch.path is PathClass.DIRECT else {"direct", "derp"}
        job = await self.jobs.get(gang)
        transport = job.value.spec.distributed.transport if job else "Auto"
        if transport == "Direct":
            wanted = {"direct"}
        worse = [r for r in results if r.ok and r.path.split(":")[0] not in wanted]
        if failed or worse:
            await self._probe_failed(gang, epoch_number, (failed or worse)[0])
            return
        await self._qualified(gang, epoch_number, nodes, results)

    async def _wait_joined(self, gang: str, epoch: int, nodes: list[str]) -> None:
        """Members record their WireGuard key when they join; give them the readiness window.
        Each member's record is read, again every JOIN_POLL_SECONDS, with the deadline kept
        here: a watch whose consumer was lost with a server (chaos seed 1) saw none of them,
        and nats-py turned the cancellation of its wait into a retried timeout, so the probe
        waited for ever instead of the window."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.readiness_seconds
        waiting = set(nodes)
        while True:
            for node in sorted(waiting):
                try:
                    if await self.members.get(f"{gang}.{epoch}.{node}") is not None:
                        waiting.discard(node)
                except NodusError as error:  # the bus failing over longer than its retries
                    log.info("%s epoch %d: %s not read yet: %s", gang, epoch, node, error)
            if not waiting:
                return
            if loop.time() >= deadline:
                log.warning("%s epoch %d: %s never joined", gang, epoch, sorted(waiting))
                return
            await asyncio.sleep(JOIN_POLL_SECONDS)

    async def _shim_checks(self, gang: str, epoch: int, nodes: list[str]) -> str | None:
        """Each member's shim self-test; the first refusal, or None. A member whose agent
        stays silent is lost (the gang placed again without it), not a shim that failed to
        load (chaos seed 518594: an agent restarting answered nobody for a moment)."""
        job = await self.jobs.get(gang)
        launcher = job.value.spec.command[:1] if job is not None else []
        request = ShimCheckRequest(gang=gang, epoch=epoch, launcher=launcher)
        replies = await asyncio.gather(
            *(
                ask(
                    self.bus,
                    n,
                    names.AgentVerb.SHIM_CHECK,
                    request,
                    ShimCheckReply,
                    each=SHIM_ANSWER_SECONDS,
                )
                for n in nodes
            ),
            return_exceptions=True,
        )
        for node, reply in zip(nodes, replies, strict=True):
            if isinstance(reply, MemberSilent):
                raise reply
            if isinstance(reply, BaseException):
                return f"{node}: the shim self-test did not run: {reply}"
            if not reply.ok:
                return f"{node}: {reply.error}"
        return None

    async def _pair(self, gang: str, epoch: int, a: str, b: str) -> PairResult:
        """The pair measured; again when a request of it was lost (an agent restarted under
        it: its probe server and its sample went with its process; or a bus server lost the
        request on the way): the platform's loss, not a failed path. Up to PAIR_TRIES times.
        An agent that stays silent is a lost member (MemberSilent)."""
        result: PairResult | None = None
        for _ in range(PAIR_TRIES):
            try:
                held = await instances(self.bus, [a, b], unanswered=PAIR_START_UNANSWERED_SECONDS)
            except MemberSilent as silent:  # no agent to serve or measure: the pair fails now
                return _failed_pair(
                    a, b, f"{silent.node} cannot serve probes: {silent}", silent.node
                )
            try:
                result = await self._measure_pair(gang, epoch, a, b, held)
            except RequestLost as lost:
                log.info("%s epoch %d: %s; measuring %s-%s again", gang, epoch, lost, a, b)
                continue
            if result.ok or await instances(self.bus, [a, b]) == held:
                return result
            log.info("%s epoch %d: an agent of %s-%s restarted; measuring again", gang, epoch, a, b)
        return result or _failed_pair(a, b, f"a request was lost in each of {PAIR_TRIES} tries", b)

    async def _measure_pair(
        self, gang: str, epoch: int, a: str, b: str, held: dict[str, str]
    ) -> PairResult:
        """a measures a->b through the workload's path; b opens its own fresh connections back.
        A failure names its suspect: the member that could not serve, or could not be reached.
        `held`: the agents' processes when the pair began (RequestLost when one changes)."""
        serve = ProbeServeRequest(gang=gang, epoch=epoch)
        ends: dict[str, ProbeServeReply] = {}
        for node in (b, a):
            try:
                ends[node] = await ask(
                    self.bus, node, names.AgentVerb.PROBE_SERVE, serve, ProbeServeReply, each=10
                )
            except NodusError as error:
                return _failed_pair(a, b, f"{node} cannot serve probes: {error}", node)
        timeout = self.readiness_seconds + self.sample_seconds + 45

        async def probe(node: str, peer: str, measure: bool) -> PairResult:
            request = ProbePairRequest(
                gang=gang,
                epoch=epoch,
                peer=peer,
                address=ends[peer].address,
                port=ends[peer].port,
                sample_seconds=self.sample_seconds,
                readiness_seconds=self.readiness_seconds,
                measure=measure,
            )
            asked = self.bus.request(
                names.node_request(node, names.AgentVerb.PROBE_PAIR), request, PairResult, timeout
            )
            holding = {node: names.probe_pair_key(gang, epoch, peer)}
            return await unless_lost(self.bus, held, asked, holding)

        forward, reverse = await asyncio.gather(
            probe(a, b, True), probe(b, a, False), return_exceptions=True
        )
        for outcome in (forward, reverse):
            if isinstance(outcome, RequestLost | MemberSilent):
                raise outcome
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

    # -- outcomes ------------------------------------------------------------------------------

    async def _qualified(
        self, gang: str, epoch: int, nodes: list[str], results: list[PairResult]
    ) -> None:
        record_pairs(gang, results)  # every pair's figures, for the gangs dashboard
        slowest = min(results, key=lambda r: r.tcp_gbps)
        t = now()
        await self._conclude_record(gang, epoch, "Qualified", t)
        probe = Probe(
            tcp_gbps=slowest.tcp_gbps,
            rtt_ms=max(r.rtt_ms for r in results),
            path=slowest.path,
            measured_time=slowest.measured_time or t,
        )

        message = (
            f"{len(results)} pairs measured; slowest {slowest.a}-{slowest.b}: "
            f"{slowest.tcp_gbps:g} Gbit/s, {slowest.rtt_ms:g} ms, {slowest.path}"
        )

        def qualified(status: JobStatus) -> lifecycle.Step:
            return lifecycle.qualified(status, probe, message, t)

        if not await advance(self.bus, gang, epoch, lifecycle.QUALIFIED, qualified):
            return
        PROBES.labels("qualified").inc()
        await self.run.launch(gang, epoch)

    async def _member_silent(self, gang: str, epoch: int, silent: MemberSilent) -> None:
        """A member's agent stopped answering during the probe: the epoch's probe failed (its
        record says why), and the gang is placed again without it."""
        message = f"{silent}; placing the gang again without it"
        await self._conclude_record(gang, epoch, "Failed", now(), str(silent))
        PROBES.labels("failed").inc()
        await restart_gang(self.bus, silent.node, gang, epoch, lifecycle.MEMBER_LOST, message)

    async def _conclude_record(
        self,
        gang: str,
        epoch: int,
        state: Literal["Qualified", "Failed"],
        t: datetime,
        reason: str | None = None,
    ) -> None:
        """The probe record's outcome: Qualified, or Failed with its reason."""

        await self.probes.mutate(
            names.epoch_key(gang, epoch),
            self._held(
                lambda r: msgspec.structs.replace(r, state=state, finished_time=t, reason=reason)
            ),
        )

    async def _probe_failed(self, gang: str, epoch: int, pair: PairResult) -> None:
        """G12: the epoch fails, not billed; the gang is placed again without the failing
        machine, continues as Relayed (an Auto gang whose direct path failed), or fails once
        it has used up its epochs."""
        t = now()
        reason = f"pair {pair.a}-{pair.b}: " + (
            pair.error or f"path {pair.path} is worse than the transport allows"
        )
        await self._conclude_record(gang, epoch, "Failed", t, reason)
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

        suspect = pair.suspect or pair.b
        if history:
            transition = lifecycle.EXHAUSTED
            next_step = f"the job fails: no qualified placement after {epoch} epochs"
        elif direct_failed:
            transition = lifecycle.RELAYED_INSTEAD
            next_step = "it continues as Relayed on the same machines"
        else:
            transition = lifecycle.PROBE_FAILED
            next_step = f"placing it again without {suspect}"

        def again(status: JobStatus) -> lifecycle.Step:
            if transition is lifecycle.EXHAUSTED:
                return lifecycle.exhausted(status, epoch, history, t)
            if transition is lifecycle.RELAYED_INSTEAD:
                return lifecycle.relayed_instead(status, reason, t)
            return lifecycle.probe_failed(status, suspect, reason, t)

        if await advance(self.bus, gang, epoch, transition, again):
            log.warning("%s epoch %d failed its probe (%s); %s", gang, epoch, reason, next_step)

    async def _shim_not_loaded(self, gang: str, epoch: int, why: str) -> None:
        t = now()
        await self._conclude_record(gang, epoch, "Failed", t, why)
        PROBES.labels("shim_not_loaded").inc()

        def failed(status: JobStatus) -> lifecycle.Step:
            return lifecycle.shim_not_loaded(status, why, t)

        await advance(self.bus, gang, epoch, lifecycle.SHIM_NOT_LOADED, failed)


def _with_pairs(done: list[PairResult]) -> Callable[[ProbeRecord], ProbeRecord]:
    return lambda record: msgspec.structs.replace(record, pairs=done)


def _failed_pair(a: str, b: str, error: str, suspect: str) -> PairResult:
    return PairResult(a=a, b=b, ok=False, error=error, suspect=suspect, measured_time=now())

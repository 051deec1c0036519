"""The gang's run (G17): once the probe qualified an epoch, its ranks are launched; every rank
exit is checked, and the job concludes Succeeded or Failed and is billed boot time, run time
and relay bytes (Relayed only). While it runs, the Direct members' paths (`nodus-paths`) set
`NetworkDegraded` (G13): True, naming the pairs, while some pair goes through the relays.
Every step is a transition of the job (libs.jobs) written by compare-and-set, so replicas that
race (or a runner that comes back after a rank exited) conclude and bill it once. A job is
concluded from the rank records its watch delivered, on each exit and again on a period."""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime
from typing import Literal

from nats.errors import Error as NatsError

from libs.bus import Bus
from libs.bus.retry import transient
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.epochs import Epoch
from libs.contracts.errors import NodusError
from libs.contracts.jobs import (
    FINISHED_PHASES,
    Job,
    JobStatus,
    PathClass,
    Phase,
)
from libs.contracts.lifecycle import LaunchReply, LaunchRequest, RankStatus, StopRequest
from libs.contracts.relay import MemberPaths
from libs.contracts.remediation import Alert, Remediation
from libs.jobs import lifecycle
from libs.jobs.lifecycle import FAULT_BROKE_MEMBER
from libs.jobs.store import advance, restart_gang
from libs.runtime.tasks import TaskSet
from services.runner.agents import MemberSilent, ask
from services.runner.billing import LateUsage
from services.runner.billing import relay_bytes as billed_relay_bytes
from services.runner.metrics import DEGRADED, JOBS, RUNS, forget_gang
from services.runner.platform import platform_cause

# How long a failed rank waits for the fault that may explain it (its alert).
PLATFORM_GRACE_SECONDS = 5.0

log = logging.getLogger("nodus.runner")

CONCLUDE_SWEEP_SECONDS = 5.0
# One try of a launch: the agent starts a process and records it (a bus write, which rides
# out a server failing over); one unanswered is asked again (services.runner.agents).
LAUNCH_ANSWER_SECONDS = 10.0
USAGE_SETTLE_SECONDS = 2.5  # > the relays' usage flush interval (0.1 s) plus delivery


class GangRun:
    """Launch, conclude and bill; shares the runner's process and bus connection."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.jobs = bus.bucket(names.BUCKET_JOBS, Job)
        self.epochs = bus.bucket(names.BUCKET_EPOCHS, Epoch)
        self.ranks = bus.bucket(names.BUCKET_RANKS, RankStatus)
        # What the remediator saw of a machine: a rank's failure may be the platform's (R17).
        self.alerts = bus.bucket(names.BUCKET_ALERTS, Alert)
        self.remediations = bus.bucket(names.BUCKET_REMEDIATIONS, Remediation)
        self.paths = bus.bucket(names.BUCKET_PATHS, MemberPaths)
        self.tasks = TaskSet("gang run", log)

        # Every rank record, as the watch delivered them (in order): a rank's exit concludes
        # from what the watch saw, not from a read that a lagging replica may answer with an
        # older record (chaos found jobs left Running with every rank exited that way).
        self._ranks: dict[str, dict[str, RankStatus]] = {}  # gang -> rank key -> record
        self._running: dict[str, int] = {}  # gang -> epoch, of the jobs Running

    async def start(self) -> None:
        self.tasks.spawn(self._watch_ranks(), name="watch-ranks")
        self.tasks.spawn(self._watch_paths(), name="watch-paths")
        self.tasks.spawn(self._count_phases(), name="count-phases")
        self.tasks.spawn(self._sweep_running(), name="sweep-running")
        self.tasks.spawn(LateUsage(self.bus).run(), name="late-usage")

    async def stop(self) -> None:
        await self.tasks.close()

    async def launch(self, gang: str, epoch: int) -> None:
        """The qualified epoch's ranks, all at once (G3); Running with the boot time billed."""
        stored = await self.epochs.get(names.epoch_key(gang, epoch))
        assert stored is not None
        job = await self.jobs.get(gang)
        command = job.value.spec.command if job is not None else []
        launches = await asyncio.gather(
            *(
                self._launch(
                    m.node, LaunchRequest(gang=gang, epoch=epoch, rank=m.rank, command=command)
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
        silent = [error for _, error in failed if isinstance(error, MemberSilent)]
        if silent:
            # The platform's loss, not the workload's: the gang is placed again without it.
            message = f"{silent[0]}; placing the gang again without it"
            await restart_gang(
                self.bus, silent[0].node, gang, epoch, lifecycle.MEMBER_LOST, message
            )
            return
        started = now()

        running = lifecycle.RUNNING
        if not await advance(
            self.bus, gang, epoch, running, lambda s: lifecycle.running(s, started)
        ):
            return
        await self._degraded(gang, epoch)  # a pair the relays carried from the start
        if failed:
            node, error = failed[0]
            await self._finish(gang, epoch, False, "LaunchFailed", f"{node}: {error}", started)
            return
        # A rank that exited before the job was Running was seen while there was nothing to
        # conclude: look once more now that there is.
        await self._conclude(gang, epoch)

    async def _watch_ranks(self) -> None:
        """The watch begins with every rank's current record: an exit that happened while no
        runner was up concludes its job when one starts."""
        async for change in self.ranks.watch():
            status = change.value
            if status is None:
                # org.name.epoch.rank.node: the gang is all but the last three fields.
                self._ranks.get(change.key.rsplit(".", 3)[0], {}).pop(change.key, None)
                continue
            self._ranks.setdefault(status.gang, {})[change.key] = status
            if status.state != "Running":
                # One task per exit: a check that runs while another rank exits must not be
                # the last one (the job's compare-and-set lets one of them conclude).
                self.tasks.spawn(
                    self._conclude(status.gang, status.epoch),
                    name=f"conclude {status.gang}.{status.epoch}",
                )

    async def _count_phases(self) -> None:
        phases: dict[str, Phase] = {}
        async for change in self.jobs.watch():
            if change.value is None:
                phases.pop(change.key, None)
                self._running.pop(change.key, None)
            else:
                phases[change.key] = change.value.status.phase
                if change.value.status.phase is Phase.RUNNING:
                    self._running[change.key] = change.value.status.epoch
                else:
                    self._running.pop(change.key, None)
                    if change.value.status.phase in FINISHED_PHASES:
                        self._ranks.pop(change.key, None)  # not needed to conclude it again
            for phase in Phase:
                JOBS.labels(phase.value).set(sum(1 for p in phases.values() if p is phase))

    async def _sweep_running(self) -> None:
        """Every Running job is looked at again on a period: an exit whose conclusion failed
        (the bus failing over under it) or was decided on an old read is not left for ever."""
        while True:
            await asyncio.sleep(CONCLUDE_SWEEP_SECONDS)
            for gang, epoch in list(self._running.items()):
                name = f"conclude {gang}.{epoch}"
                busy = any(task.get_name() == name for task in self.tasks)
                if self._some_ended(gang, epoch) and not busy:
                    self.tasks.spawn(self._conclude(gang, epoch), name=name)

    def _some_ended(self, gang: str, epoch: int) -> bool:
        prefix = f"{gang}.{epoch}."
        ranks = self._ranks.get(gang, {})
        return any(r.state != "Running" for k, r in ranks.items() if k.startswith(prefix))

    async def _watch_paths(self) -> None:
        async for change in self.paths.watch():
            paths = change.value
            if paths is None:
                continue
            try:
                await self._degraded(paths.gang, paths.epoch)
            except NodusError as error:  # this gang's condition: the watch goes on for all
                log.warning(
                    "%s epoch %d: NetworkDegraded not updated: %s", paths.gang, paths.epoch, error
                )

    async def _degraded(self, gang: str, epoch: int) -> None:
        """`NetworkDegraded` from what every member says of its pairs, on a Running job."""
        found = await self.paths.snapshot(f"{gang}.{epoch}.*")
        slow: dict[tuple[str, str], str] = {}
        for record in found.values():
            for peer, path in record.value.paths.items():
                if path != "direct":
                    slow[(min(record.value.node, peer), max(record.value.node, peer))] = path
        t = now()
        state: Literal["True", "False"]
        if slow:
            pairs = ", ".join(f"{a}-{b} ({path})" for (a, b), path in sorted(slow.items()))
            state, reason, message = "True", "RelayFallback", f"through the relays: {pairs}"
        else:
            state, reason, message = "False", "AllDirect", "every pair is direct"

        def degraded(status: JobStatus) -> lifecycle.Step:
            return lifecycle.degraded(status, state, reason, message, t)

        if found and await advance(self.bus, gang, epoch, lifecycle.DEGRADED, degraded):
            DEGRADED.labels(gang).set(1 if slow else 0)  # running gangs only (forget_gang)
            log.info("%s epoch %d: NetworkDegraded=%s: %s", gang, epoch, state, message)

    async def _launch(self, node: str, request: LaunchRequest) -> LaunchReply:
        """Launch one rank; asked again while unanswered (the agent starts a rank once, so a
        launch whose answer a failing-over bus lost is answered "already started"); an agent
        silent past the deadline is a lost member (see `launch`), not a failed workload."""
        return await ask(
            self.bus, node, names.AgentVerb.LAUNCH, request, LaunchReply, LAUNCH_ANSWER_SECONDS
        )

    async def _conclude(self, gang: str, epoch: int) -> None:
        """Conclude the job if its ranks say so. A bus that does not answer for longer than a
        call's retries (a server failing over on a loaded machine) leaves it to the sweep,
        which looks again every CONCLUDE_SWEEP_SECONDS: said, not a crash."""
        try:
            await self._conclude_now(gang, epoch)
        except Exception as error:
            if not transient(error):
                raise
            log.warning(
                "%s epoch %d: not concluded yet, the bus did not answer (%s); trying again "
                "within %.0f s",
                gang,
                epoch,
                error or type(error).__name__,
                CONCLUDE_SWEEP_SECONDS,
            )

    async def _conclude_now(self, gang: str, epoch: int) -> None:
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
        keys = [names.rank_key(gang, epoch, m.rank, m.node) for m in stored.value.members]
        ranks = self._ranks.get(gang, {})
        statuses = [ranks[key] for key in keys if key in ranks]
        members = {m.rank: m.node for m in stored.value.members}
        # A rank the platform stopped (fencing, a machine going away) is not the workload
        # failing: the gang is re-placed by the member-loss path instead.
        failed = [s for s in statuses if s.state == "Exited" and s.exit_code]
        if failed:
            first = min(failed, key=lambda s: s.ended_time or now())
            if await self._platform_failed(gang, epoch, first):
                return
            await self._finish(
                gang,
                epoch,
                False,
                "RankFailed",
                f"rank {first.rank} on {first.node} exited with code {first.exit_code}",
                first.ended_time or now(),
            )
            return
        done = [s for s in statuses if s.state == "Exited" and s.exit_code == 0]
        if len(done) == len(members):
            last = max((s.ended_time or now() for s in done), default=now())
            await self._finish(
                gang, epoch, True, "Completed", f"all {len(members)} ranks exited 0", last
            )

    async def _platform_failed(self, gang: str, epoch: int, rank: RankStatus) -> bool:
        """R17: the rank's machine had a fault that breaks a member, or a repair was taking
        it: a member loss (placed again without the machine), not the workload failing. The
        fault's alert may come a moment after the rank died: it is waited for, briefly."""
        ended = rank.ended_time or now()
        deadline = asyncio.get_running_loop().time() + PLATFORM_GRACE_SECONDS
        while True:
            try:
                alerts = await self.alerts.snapshot(f"{rank.node}.>")
                repairs = await self.remediations.snapshot(f"{rank.node}.>")
            except (NodusError, NatsError, OSError, TimeoutError) as error:
                # What the remediator saw is unknown: the rank's exit decides, as before R17.
                log.warning("%s: %s's faults not read: %s", gang, rank.node, error)
                return False
            cause = platform_cause(
                rank.node,
                ended,
                [a.value for a in alerts.values()],
                [r.value for r in repairs.values()],
            )
            if cause is not None or asyncio.get_running_loop().time() >= deadline:
                break
            await asyncio.sleep(0.5)
        if cause is None:
            return False
        message = (
            f"rank {rank.rank} on {rank.node} exited with code {rank.exit_code} because of the "
            f"platform: {cause}; epoch {epoch} ends and the gang is placed again without it"
        )
        return await restart_gang(self.bus, rank.node, gang, epoch, FAULT_BROKE_MEMBER, message)

    async def _finish(
        self, gang: str, epoch: int, succeeded: bool, reason: str, message: str, t: datetime
    ) -> None:
        """The end at `t` (when the ranks ended, even if no runner was up then), billed once:
        the compare-and-set from Running lets one writer conclude."""
        # Relays publish what members sent every 0.1 s: wait for the last flush of the run.
        stored = await self.epochs.get(names.epoch_key(gang, epoch))
        relay_bytes = 0
        # G17: Relayed traffic is billed; a Direct pair's fallback through the relays is not.
        if stored is None or stored.value.path is PathClass.RELAYED:
            await asyncio.sleep(USAGE_SETTLE_SECONDS)
            relay_bytes = await billed_relay_bytes(self.bus, gang)

        def finished(status: JobStatus) -> lifecycle.Step:
            return lifecycle.finished(status, succeeded, reason, message, t, relay_bytes)

        forget_gang(gang)  # every replica that saw the end: its series of the gang go
        end = lifecycle.SUCCEEDED if succeeded else lifecycle.FAILED
        if await advance(self.bus, gang, epoch, end, finished):
            RUNS.labels("succeeded" if succeeded else "failed").inc()
            log.info(
                "%s epoch %d %s: %s", gang, epoch, "succeeded" if succeeded else "failed", message
            )
            if not succeeded:
                stored = await self.epochs.get(names.epoch_key(gang, epoch))
                for member in stored.value.members if stored else []:
                    try:
                        await self.bus.request(
                            names.node_request(member.node, names.AgentVerb.STOP),
                            StopRequest(gang=gang, epoch=epoch),
                            LaunchReply,
                            15,
                        )
                    except NodusError as error:
                        log.warning("stopping %s on %s: %s", gang, member.node, error)

"""What an agent does for the gangs it belongs to once placed: serve and run probes (G10), run
the shim self-test with the image's launcher (G10.3), launch and stop ranks, hand out logs."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

from libs.bus import Bus, Endpoint
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.bounds import SHIM_SELF_TEST_SECONDS
from libs.contracts.epochs import Epoch, EpochMember
from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.jobs import PathClass
from libs.contracts.lifecycle import (
    LaunchReply,
    LaunchRequest,
    LogsReply,
    LogsRequest,
    PairResult,
    ProbePairRequest,
    ProbeServeReply,
    ProbeServeRequest,
    RankStatus,
    ShimCheckReply,
    ShimCheckRequest,
    StopRequest,
)
from libs.runtime.processes import reaped
from services.agent.probeserver import ProbeServer
from services.agent.ranks import RankRunner

log = logging.getLogger("nodus.agent.gang")
REPO = str(Path(__file__).resolve().parents[2])  # where `services.agent.probe` imports from


# A Direct member's address is nodus0's: it appears once the agent has made the device,
# which may be a moment after the runner saw the member join.
ADDRESS_WAIT = 10.0
# A Direct pair whose path dropped while it was measured runs its checks again, the relays
# carrying it meanwhile (services/agent/direct); measured again once it is back within this.
DIRECT_AGAIN_WAIT = 10.0


async def _start_when_address_is_up(server: ProbeServer, wait: float) -> None:
    deadline = asyncio.get_running_loop().time() + wait
    while True:
        try:
            await server.start()
            return
        except OSError as error:
            if error.errno != errno.EADDRNOTAVAIL or asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.1)


class GangWork:
    def __init__(
        self,
        bus: Bus,
        node: str,
        log_dir: Path,
        path_of: Callable[[str, int, str], Awaitable[str | None]],
        joined_epoch: Callable[[str, int], Epoch],
        scratch_dir: Path | None = None,
        address_never_up: Callable[[str, int], str | None] = lambda gang, epoch: None,
    ) -> None:
        self.address_never_up = address_never_up  # why an epoch's address cannot come up here
        self.bus = bus
        # The machine's local disk for ranks (NODUS_SCRATCH_DIR): kept by a reboot, lost to a
        # reprovision or a migration, as a VM's local disk is.
        self.scratch_dir = scratch_dir
        self.node = node
        self.joined_epoch = joined_epoch  # the epochs this node joined, by their keys
        self.runner = RankRunner(node, bus.bucket(names.BUCKET_RANKS, RankStatus), log_dir)
        self.servers: dict[tuple[str, int], ProbeServer] = {}
        self.probing: set[str] = set()  # probe pairs being measured (NodeInfoReply.probing)
        self.path_of = path_of  # the path to a peer now: direct | derp:<region>

    def endpoints(self) -> list[Endpoint]:  # type: ignore[type-arg]
        verb, node = names.AgentVerb, self.node

        return [
            Endpoint.of_agent(node, verb.PROBE_SERVE, ProbeServeRequest, self.probe_serve),
            Endpoint.of_agent(
                node, verb.PROBE_PAIR, ProbePairRequest, self.probe_pair, concurrency=8
            ),
            Endpoint.of_agent(
                node, verb.SHIM_CHECK, ShimCheckRequest, self.shim_check, concurrency=4
            ),
            Endpoint.of_agent(node, verb.LAUNCH, LaunchRequest, self.launch),
            Endpoint.of_agent(node, verb.LOGS, LogsRequest, self.logs),
            Endpoint.of_agent(node, verb.STOP, StopRequest, self.stop),
        ]

    async def _member(self, gang: str, epoch: int) -> tuple[Epoch, EpochMember]:
        """The epoch as its join key brought it: one this agent holds a key of, unfenced
        (a fenced epoch's key is deleted, and the agent leaves it)."""
        record = self.joined_epoch(gang, epoch)
        member = next((m for m in record.members if m.node == self.node), None)
        if member is None:
            raise NodusError(
                ErrorCode.NOT_FOUND, f"{self.node} is not a member of {gang} epoch {epoch}"
            )
        return record, member

    async def probe_serve(self, request: ProbeServeRequest) -> ProbeServeReply:
        _, member = await self._member(request.gang, request.epoch)
        key = (request.gang, request.epoch)
        if key not in self.servers:
            never = self.address_never_up(request.gang, request.epoch)
            if never is not None:
                raise NodusError(
                    ErrorCode.ADDRESS_UNAVAILABLE,
                    f"{self.node} cannot listen on its advertised address {member.address}: "
                    f"{never}",
                )
            server = ProbeServer(member.address)
            try:
                await _start_when_address_is_up(server, ADDRESS_WAIT)
            except OSError as error:  # the probe fails honestly; the agent is fine
                raise NodusError(
                    ErrorCode.ADDRESS_UNAVAILABLE,
                    f"{self.node} cannot listen on its advertised address {member.address}: "
                    f"{error.strerror or error}",
                ) from None
            self.servers[key] = server
        return ProbeServeReply(address=member.address, port=self.servers[key].port)

    async def probe_pair(self, request: ProbePairRequest) -> PairResult:
        """Probe one peer from a separate process with this rank's environment: on the Relayed
        path its connections go through the shim, SOCKS5 and the relays, as the workload's do.

        A Direct pair that was direct at the sample's start or end but not at both (its path
        dropped, as a first handshake through a NAT may on a loaded host, and checks ran again)
        is measured once more when it is direct again; a pair the relays carried at both ends is
        reported on the relays (G12)."""
        held = names.probe_pair_key(request.gang, request.epoch, request.peer)
        self.probing.add(held)
        try:
            return await self._measured_pair(request)
        finally:
            self.probing.discard(held)

    async def _measured_pair(self, request: ProbePairRequest) -> PairResult:
        result, direct_once = await self._probe_pair(request)
        if (
            result.ok
            and result.path != "direct"
            and direct_once
            and await self._direct_again(request)
        ):
            log.info(
                "%s-%s was on %s while measured; direct again: measuring again",
                self.node,
                request.peer,
                result.path,
            )
            result, _ = await self._probe_pair(request)
        return result

    async def _direct_again(self, request: ProbePairRequest) -> bool:
        """Whether the pair is a Direct epoch's and goes peer to peer within DIRECT_AGAIN_WAIT."""
        epoch, _ = await self._member(request.gang, request.epoch)
        if epoch.path is not PathClass.DIRECT:
            return False
        deadline = asyncio.get_running_loop().time() + DIRECT_AGAIN_WAIT
        while asyncio.get_running_loop().time() < deadline:
            if await self.path_of(request.gang, request.epoch, request.peer) == "direct":
                return True
            await asyncio.sleep(0.2)
        return False

    async def _probe_pair(self, request: ProbePairRequest) -> tuple[PairResult, bool]:
        """The pair's result, and whether its path was direct at the sample's start or end."""
        epoch, member = await self._member(request.gang, request.epoch)
        # The path the bytes take (on Direct, once the pair's checks ended), before and after.
        before = await self.path_of(request.gang, request.epoch, request.peer)
        command = [
            sys.executable,
            "-m",
            "services.agent.probe",
            "--address",
            request.address,
            "--port",
            str(request.port),
            "--connections",
            str(request.connections),
            "--seconds",
            str(request.sample_seconds),
            "--readiness",
            str(request.readiness_seconds),
        ]
        if not request.measure:
            command.append("--no-measure")
        env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "PYTHONPATH")}
        env.update(member.env)
        process = await asyncio.create_subprocess_exec(
            *command,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=REPO,
        )
        timeout = request.readiness_seconds + request.sample_seconds + 30
        try:
            async with reaped(process):  # timed out, or the agent is stopping: no orphan
                stdout, stderr = await asyncio.wait_for(process.communicate(), timeout)
        except TimeoutError:
            return PairResult(a=self.node, b=request.peer, ok=False, error="probe timed out"), False
        try:
            result = json.loads(stdout.decode().strip().splitlines()[-1])
        except (ValueError, IndexError):
            detail = stderr.decode(errors="replace").strip()[-400:]
            crashed = PairResult(
                a=self.node, b=request.peer, ok=False, error=f"probe crashed: {detail}"
            )
            return crashed, False
        after = await self.path_of(request.gang, request.epoch, request.peer)
        if epoch.path is PathClass.RELAYED:
            path = after or "derp:unknown"
        elif epoch.path is PathClass.DIRECT:  # direct only if the bytes went peer to peer
            path = next((p for p in (before, after) if p and p != "direct"), "direct")
        else:
            path = "direct"
        measured = PairResult(
            a=self.node,
            b=request.peer,
            ok=result["error"] is None,
            rtt_ms=result["rttMs"],
            tcp_gbps=result["tcpGbps"],
            path=path,
            connections=result["connections"],
            error=result["error"],
            measured_time=now(),
        )
        return measured, "direct" in (before, after)

    async def shim_check(self, request: ShimCheckRequest) -> ShimCheckReply:
        """G10.3: the image's own launcher (the command's first word) must load the shim."""
        from libs.netshim import NetshimCheckError, self_test_async

        launcher = request.launcher
        if not launcher:
            raise NodusError(ErrorCode.INVALID, f"{request.gang}: no launcher to check")
        try:
            result = await self_test_async(launcher, timeout=SHIM_SELF_TEST_SECONDS)
        except NetshimCheckError as error:
            return ShimCheckReply(node=self.node, ok=False, error=f"CheckFailed: {error}")
        return ShimCheckReply(
            node=self.node,
            ok=result.ok,
            error=None if result.ok else f"{result.reason}: {result.message}",
        )

    async def launch(self, request: LaunchRequest) -> LaunchReply:
        _, member = await self._member(request.gang, request.epoch)
        if member.rank != request.rank:
            raise NodusError(
                ErrorCode.INVALID, f"{self.node} is rank {member.rank}, not {request.rank}"
            )
        if not request.command:
            raise NodusError(ErrorCode.INVALID, f"{request.gang}: no command to launch")
        env = dict(member.env)
        if self.scratch_dir is not None:
            await asyncio.to_thread(self.scratch_dir.mkdir, parents=True, exist_ok=True)
            env["NODUS_SCRATCH_DIR"] = str(self.scratch_dir)
        started = await self.runner.launch(
            request.gang, request.epoch, request.rank, request.command, env
        )
        return LaunchReply(started=started)

    async def logs(self, request: LogsRequest) -> LogsReply:
        data, offset = self.runner.read_log(
            request.gang, request.epoch, request.rank, request.offset, request.limit
        )
        entry = self.runner.running.get(
            names.rank_key(request.gang, request.epoch, request.rank, self.node)
        )
        return LogsReply(data=data, offset=offset, state=entry.status.state if entry else "Unknown")

    async def stop(self, request: StopRequest) -> LaunchReply:
        stopped = await self.stop_epoch(request.gang, request.epoch)
        return LaunchReply(started=stopped > 0)

    async def stop_epoch(self, gang: str, epoch: int) -> int:
        server = self.servers.pop((gang, epoch), None)
        if server is not None:
            await server.stop()
        return await self.runner.stop(gang, epoch)

    async def close(self, keep_ranks: bool = False) -> None:
        """Stop serving probes, and stop the ranks, or, when the agent stops but the machine
        does not (an upgrade, O4), leave them running for the next agent to adopt."""
        for server in self.servers.values():
            await server.stop()
        self.servers.clear()
        if keep_ranks:
            await self.runner.release()
        else:
            await self.runner.stop_all()

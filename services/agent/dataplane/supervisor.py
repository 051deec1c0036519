"""The agent's side of the dataplane processes: start one for an epoch, find it again after the
agent restarted (pid and start time, same boot), ask it over its control socket, stop it, and
show its metrics on the agent's /metrics.

A dataplane runs in a session of its own (`start_new_session`), logs to a file of its own
beside the agent's, and is no asyncio child of the agent: asyncio kills the children it
spawned when their transport closes, and these must outlive the agent (O4)."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from libs.contracts.base import now
from libs.contracts.dataplane import (
    ControlReply,
    DataplaneProcess,
    MetricsRequest,
    PathRequest,
    StatusRequest,
    StopRequest,
)
from libs.contracts.errors import ErrorCode, NodusError
from services.agent import procs
from services.agent.dataplane import control
from services.agent.dataplane.store import EpochStore

log = logging.getLogger("nodus.agent.dataplane")

REPO = str(Path(__file__).resolve().parents[3])  # where `services.agent.dataplane` imports from
READY_WAIT = 120.0  # relays to appear (30 s) and the tunnel or nodus0 to come up
PATH_WAIT = 60.0  # a Direct pair's first round of checks (direct.FIRST_ROUND_WAIT is 55 s)
STOP_WAIT = 10.0


class Dataplane(Protocol):
    """An epoch's dataplane as the agent uses it, in its own process or in the agent's."""

    async def start(self) -> None: ...  # until ready; NodusError if it cannot start

    async def stop(self) -> None: ...

    async def detach(self) -> None: ...  # the agent stops, the machine does not (O4)

    def running(self) -> bool: ...

    async def home(self) -> tuple[str, str] | None: ...  # Relayed: (derp:<region>, relay)

    async def path_to(self, peer: str) -> str | None: ...


@dataclass(frozen=True)
class Launch:
    """How the agent starts dataplane processes: the bus they connect to as the agent's own
    user, and where they log (None: the agent's own stderr, the journal say)."""

    url: str
    credentials: str | None
    log_dir: Path | None = None


def log_dir_beside_stderr() -> Path | None:
    """The directory of the file the agent logs to (`nodus up`: STATE_DIR/logs, whose files
    the end-to-end tests check for errors); None when stderr is no file."""
    try:
        target = os.readlink("/proc/self/fd/2")
    except OSError:
        return None
    path = Path(target)
    return path.parent if path.is_absolute() and path.is_file() else None


class ProcessDataplane:
    """One epoch's dataplane process: started by this agent, or adopted from the one before."""

    def __init__(
        self,
        store: EpochStore,
        key: str,
        record: DataplaneProcess,
        child: subprocess.Popen[bytes] | None = None,
    ) -> None:
        self.store = store
        self.key = key
        self.record = record
        self.socket = store.socket(key)
        self._child = child

    @classmethod
    def spawn(cls, launch: Launch, store: EpochStore, key: str, boot_id: str) -> ProcessDataplane:
        command = [
            sys.executable,
            "-m",
            "services.agent.dataplane",
            "--epoch-dir",
            str(store.directory(key)),
            "--nats",
            launch.url,
        ]
        if launch.credentials:
            command += ["--credentials", launch.credentials]
        output: int | None = None
        if launch.log_dir is not None:
            launch.log_dir.mkdir(parents=True, exist_ok=True)
            output = os.open(
                launch.log_dir / f"dataplane-{key}.log",
                os.O_WRONLY | os.O_CREAT | os.O_APPEND,
                0o644,
            )
        try:
            child = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT if output is not None else None,
                cwd=REPO,
                start_new_session=True,  # its own session: the agent's end is not its end
            )
        finally:
            if output is not None:
                os.close(output)
        ticks = procs.start_ticks(child.pid) or 0
        record = DataplaneProcess(
            pid=child.pid, start_ticks=ticks, boot_id=boot_id, started_time=now()
        )
        store.save_process(key, record)
        log.info("%s: dataplane process %d started", key, child.pid)
        return cls(store, key, record, child)

    @classmethod
    def adopt(
        cls, store: EpochStore, key: str, record: DataplaneProcess
    ) -> ProcessDataplane | None:
        """The process the agent before this one started, if it still runs."""
        if not procs.alive(record.pid, record.start_ticks):
            return None
        log.info("%s: dataplane process %d adopted", key, record.pid)
        return cls(store, key, record)

    def running(self) -> bool:
        if self._child is not None and self._child.poll() is not None:
            return False  # ended (and reaped just now)
        return procs.alive(self.record.pid, self.record.start_ticks)

    async def request(self, message: StatusRequest | PathRequest, timeout: float) -> ControlReply:
        return await control.request(self.socket, message, timeout)

    async def start(self) -> None:
        """Until the process says its dataplane is up; NodusError with its reason if it ends
        or gives up first."""
        deadline = asyncio.get_running_loop().time() + READY_WAIT
        while True:
            if not self.running():
                why = self.store.take_failure(self.key) or "see its log"
                raise NodusError(
                    ErrorCode.ADDRESS_UNAVAILABLE,
                    f"the dataplane process {self.record.pid} ended: {why} "
                    f"(its log: dataplane-{self.key}.log)",
                )
            try:
                reply = await self.request(StatusRequest(), 2.0)
            except NodusError:  # not listening yet
                reply = None
            if reply is not None and reply.ready:
                return
            if reply is not None and reply.failed:
                raise NodusError(ErrorCode.ADDRESS_UNAVAILABLE, reply.failed)
            if asyncio.get_running_loop().time() > deadline:
                raise NodusError(ErrorCode.TIMEOUT, f"{self.key}: the dataplane never got ready")
            await asyncio.sleep(0.1)

    async def home(self) -> tuple[str, str] | None:
        reply = await self.request(StatusRequest(), 2.0)
        if reply.path is None or reply.relay is None:
            return None
        return reply.path, reply.relay

    async def path_to(self, peer: str) -> str | None:
        reply = await self.request(PathRequest(peer=peer, wait=PATH_WAIT), PATH_WAIT + 5.0)
        return reply.path

    async def wait(self) -> None:
        """Until the process ended; reaped if it is this process's child."""
        await procs.exited(self.record.pid)
        if self._child is not None:
            self._child.poll()
        else:
            try:  # the same agent program after an exec (the lab's reboot) is still its parent
                os.waitpid(self.record.pid, os.WNOHANG)  # noqa: ASYNC222 - WNOHANG: no wait
            except ChildProcessError:
                pass

    async def stop(self) -> None:
        """Ask it to stop (it ends its epoch's records and devices), then SIGTERM, then SIGKILL
        to its whole process group."""
        if self.running():
            try:
                await control.request(self.socket, StopRequest(), 2.0)
            except NodusError:
                procs.kill_group(self.record.pid, self.record.start_ticks, signal.SIGTERM)
            try:
                await asyncio.wait_for(self.wait(), STOP_WAIT)
            except TimeoutError:
                log.warning("%s: dataplane %d did not stop; killed", self.key, self.record.pid)
                procs.kill_group(self.record.pid, self.record.start_ticks)
                await self.wait()
        self.store.forget_process(self.key)

    def kill(self) -> None:
        procs.kill_group(self.record.pid, self.record.start_ticks)

    async def detach(self) -> None:
        """The agent stops and leaves the process running for the next agent."""
        self._child = None


def kill_stale(record: DataplaneProcess | None) -> bool:
    """Kill a dataplane process (and its group) recorded by another boot of the machine (a lab
    reboot leaves processes alive on the shared kernel; a real reboot already ended them)."""
    if record is None:
        return False
    return procs.kill_group(record.pid, record.start_ticks)


class DataplaneMetrics:
    """A collector for the agent's registry: each running dataplane's own families, fetched
    over its control socket when /metrics is scraped, the same series of several summed (one
    node's counters; a dataplane restarted starts its counters again, as any process does)."""

    def __init__(
        self, sockets: Callable[[], Iterable[Path]], declared: Iterable[Metric] = ()
    ) -> None:
        self.sockets = sockets
        # Families declared even while no dataplane runs: dashboards and alert rules name them.
        self.declared = list(declared)

    def describe(self) -> list[Metric]:
        return []  # names unknown until scraped; nothing to check against at register

    def collect(self) -> Iterable[Metric]:
        merged: dict[str, Metric] = {}
        values: dict[tuple[str, str, tuple[tuple[str, str], ...]], float] = {}
        for socket in list(self.sockets()):
            try:
                reply = control.request_blocking(socket, MetricsRequest(), 1.0)
            except NodusError as error:  # ending or starting: its series are away this time
                log.debug("metrics of %s: %s", socket, error)
                continue
            for family in text_string_to_metric_families(reply.metrics):
                for sample in family.samples:
                    if sample.name.endswith("_created"):
                        continue  # per process; meaningless summed
                    # Only families with series: one the dataplane merely imported may be the
                    # agent's own (nodus_agent_wireguard_info), and a name twice is an error.
                    merged.setdefault(
                        family.name, Metric(family.name, family.documentation, family.type)
                    )
                    labels = tuple(sorted(sample.labels.items()))
                    index = (family.name, sample.name, labels)
                    values[index] = values.get(index, 0.0) + sample.value
        for (name, sample_name, labels), value in values.items():
            merged[name].add_sample(sample_name, dict(labels), value)
        for family in self.declared:
            merged.setdefault(family.name, Metric(family.name, family.documentation, family.type))
        return list(merged.values())


def dataplane_families() -> list[Metric]:
    """The families a dataplane process exports (its modules' metrics), for an agent whose
    dataplanes run as processes: imported here only to be described, and taken out of this
    process's registry, where the dataplanes' own series come through DataplaneMetrics."""
    from prometheus_client import REGISTRY
    from prometheus_client.metrics import MetricWrapperBase

    from services.agent.direct import fallback
    from services.agent.direct import member as direct
    from services.agent.relayed import homing, sockets, socks, tunnel, wgdevice

    families: list[Metric] = []
    for module in (direct, fallback, homing, sockets, socks, tunnel, wgdevice):
        for value in vars(module).values():
            if isinstance(value, MetricWrapperBase):
                families.extend(value.describe())
                try:
                    REGISTRY.unregister(value)
                except KeyError:  # taken out already (a second agent in this process)
                    pass
    return families

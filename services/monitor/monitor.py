"""`nodus monitor`: the detector runner. Reads each machine's inputs (kernel log, DCGM, NPD,
InfiniBand sysfs), probes host reachability, notes missing heartbeats, and writes one
level-triggered `SignalReport` per node and source to `nodus-signals` (`<node>.<source>`)
when what it sees changes, and at least every `keepalive` seconds.

Under `nodus up` it runs for every local machine, reading `STATE_DIR/machines/NAME/`; on a real
host it runs for the machine it sits on (`--node` with `--kmsg`, `--dcgm`, `--npd`,
`--infiniband`).

Each source of each machine is read on a thread of its own with a bound (`source_timeout`): a
source that overruns is counted and skipped for that scan (its last report stands) while the
others are reported as usual. The kernel's record device (`--kmsg /dev/kmsg`) is also watched
between scans, so a new record is read, and its report written, as soon as the kernel logs it."""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import time
from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path

from libs.bus import Bus
from libs.bus.auth import may_publish, monitor_inbox
from libs.contracts import names
from libs.contracts.api import NodeInfoReply, NodeInfoRequest
from libs.contracts.base import now as utc_now
from libs.contracts.bounds import HEARTBEAT_TIMEOUT_SECONDS
from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.fleet import NodeHealth
from libs.contracts.remediation import Finding, SignalReport
from libs.runtime import add_common_flags, run_daemon
from libs.runtime.tasks import cancel_and_wait
from libs.runtime.version import VERSION
from services.monitor import metrics
from services.monitor.detectors.kmsgdevice import is_record_device
from services.monitor.detectors.machine import (
    SOURCES,
    MachineDetectors,
    MachinePaths,
    default_kmsg_cursor,
)
from services.monitor.detectors.reachability import Reachability, heartbeat
from services.monitor.ondemand import Diagnostics
from services.monitor.sourcereader import Overrun, SourceReader

log = logging.getLogger("nodus.monitor")

SOURCE_TIMEOUT_SECONDS = 5.0  # one source's read, before the scan goes on without it
KMSG_BATCH_SECONDS = 0.02  # after a wake-up, let a burst of records gather before reading
# How long a machine's monitor waits for the bus to say who it is before it gives up: its own
# user is answered at once; one that is not answered is not its own (a slow bus is waited for).
WHO_AM_I_WAIT_MONITOR = 10.0

# In a lab machine's directory: the simulated network partition the reachability probe honours.
BLACKHOLE = "blackhole"

# The lab's: write a healthy machine's inputs where missing (directory, its GPUs).
Simulate = Callable[[Path, int], None]


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _signature(findings: list[Finding]) -> frozenset[tuple[str, str, int | None, str]]:
    return frozenset((f.kind.value, f.subject, f.xid, f.severity) for f in findings)


class Monitor:
    def __init__(
        self,
        bus: Bus,
        machines: dict[str, MachinePaths],
        interval: float = 1.0,
        keepalive: float = 60.0,
        reachability: bool = True,
        probe_timeout: float = 1.0,
        unreachable_after: int = 3,
        unreachable_seconds: float = HEARTBEAT_TIMEOUT_SECONDS,
        heartbeat_timeout: float = HEARTBEAT_TIMEOUT_SECONDS,
        blackholes: dict[str, Path] | None = None,
        clock: Callable[[], datetime] = utc_now,
        source_timeout: float = SOURCE_TIMEOUT_SECONDS,
    ) -> None:
        self.bus = bus
        self.interval = interval
        self.keepalive = timedelta(seconds=keepalive)
        self.reachability = reachability
        self.probe_timeout = probe_timeout
        self.heartbeat_timeout = timedelta(seconds=heartbeat_timeout)
        self.blackholes = blackholes or {}
        self.clock = clock
        self.source_timeout = source_timeout
        self.detectors = {node: MachineDetectors(node, paths) for node, paths in machines.items()}
        self._readers = {
            (node, source): SourceReader[list[Finding]](f"monitor-{source}-{node}")
            for node in machines
            for source in SOURCES
        }
        # One read and report of a source at a time (the periodic scan, the kernel log's wake-up)
        self._source_locks = {key: asyncio.Lock() for key in self._readers}
        self._overrunning: set[tuple[str, str]] = set()
        self.probes = {
            node: Reachability(
                node,
                names.node_request(node, names.AgentVerb.INFO),
                unreachable_after,
                timedelta(seconds=unreachable_seconds),
            )
            for node in machines
        }
        self.signals = bus.bucket(names.BUCKET_SIGNALS, SignalReport)
        self.health_bucket = bus.bucket(names.BUCKET_HEALTH, NodeHealth)
        self.health: dict[str, NodeHealth] = {}
        self._sent: dict[str, tuple[frozenset[tuple[str, str, int | None, str]], datetime]] = {}
        self._malformed: dict[tuple[str, str], int] = {}
        self._started = utc_now()
        self._tasks: list[asyncio.Task[None]] = []

    async def follow_health(self) -> None:
        """Heartbeats and boot ids, for NotReady and for the reports; `start` calls it."""
        caught_up = asyncio.Event()
        self._tasks.append(asyncio.create_task(self._watch_health(caught_up)))
        await caught_up.wait()

    async def start(self) -> None:
        await self.follow_health()
        self._tasks.append(asyncio.create_task(self._loop()))
        for node, detectors in self.detectors.items():
            if is_record_device(detectors.paths.kmsg):
                self._tasks.append(asyncio.create_task(self._follow_kernel_log(node)))
        log.info("monitoring %d machines every %gs", len(self.detectors), self.interval)

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)
        for key, reader in self._readers.items():
            reader.close()
            if not reader.busy:  # a stuck read still uses its detector; the process exits
                self.detectors[key[0]].close()

    async def _watch_health(self, caught_up: asyncio.Event) -> None:
        # A machine's own monitor may read only its machine's heartbeat (S1).
        keys = next(iter(self.detectors)) if len(self.detectors) == 1 else ">"
        async for change in self.health_bucket.watch(keys, caught_up=caught_up):
            if change.value is None:
                self.health.pop(change.key, None)
            else:
                self.health[change.key] = change.value

    async def _loop(self) -> None:
        while True:
            try:
                await self.scan()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("scan failed; trying again")
            await asyncio.sleep(self.interval)

    async def scan(self) -> int:
        """One pass over every machine; returns how many reports were written."""
        now = self.clock()
        sources = [
            self._scan_source(node, source, now) for node in self.detectors for source in SOURCES
        ]
        probes = []
        if self.reachability:
            # A machine that never registered has no agent to answer yet (it is booting).
            reachable = [node for node in self.detectors if node in self.health]
            probes = [self._probe(node, now) for node in reachable]
        done = await asyncio.gather(*sources, *probes)
        written = sum(1 for result in done[: len(sources)] if result)
        for node in self.detectors:
            hosts: dict[str, list[Finding]] = {}
            if self.reachability:
                hosts["reachability"] = self.probes[node].findings(now)
            beat = self.health.get(node)
            if now - self._started > self.heartbeat_timeout:
                hosts["heartbeat"] = heartbeat(
                    node, beat.heartbeat_time if beat else None, self.heartbeat_timeout, now
                )
            for source, findings in hosts.items():
                if await self._report(node, source, findings, 0, now):
                    written += 1
        return written

    async def _scan_source(self, node: str, source: str, now: datetime) -> bool:
        """Reads one source of one machine within its bound and reports it; True if written."""
        key = (node, source)
        detectors = self.detectors[node]
        async with self._source_locks[key]:
            try:
                findings = await self._readers[key].read(
                    lambda: self._timed_read(detectors, source, now), self.source_timeout
                )
            except Overrun as overrun:
                metrics.SOURCE_OVERRUNS.labels(source).inc()
                if key not in self._overrunning:  # once per episode: it may last
                    log.warning(
                        "%s: the %s source is %s; scanning the others without it",
                        node,
                        source,
                        overrun,
                    )
                    self._overrunning.add(key)
                return False
            except Exception:  # a detector's bug: that source waits, the others are reported
                log.exception("%s: reading the %s source failed", node, source)
                return False
            if key in self._overrunning:
                self._overrunning.discard(key)
                log.info("%s: the %s source answers again", node, source)
            malformed = detectors.malformed.get(source, 0)
            seen = self._malformed.get(key, 0)
            if malformed > seen:
                metrics.MALFORMED_INPUTS.labels(source).inc(malformed - seen)
                self._malformed[key] = malformed
            return await self._report(node, source, findings, malformed, now)

    @staticmethod
    def _timed_read(detectors: MachineDetectors, source: str, now: datetime) -> list[Finding]:
        started = time.perf_counter()
        try:
            return detectors.scan_source(source, now)
        finally:
            metrics.SOURCE_SECONDS.labels(source).observe(time.perf_counter() - started)

    async def _follow_kernel_log(self, node: str) -> None:
        """Between scans, wait for the record device to have a record (or an overwrite) and
        read it at once: an Xid is reported as the kernel logs it, not at the next scan."""
        loop = asyncio.get_running_loop()
        detectors = self.detectors[node]
        closed_for = 0.0
        while True:
            fd = detectors.kmsg_fileno()
            if fd is None:  # not open yet: the first scan opens it (or failed to; it tries again)
                pause = KMSG_BATCH_SECONDS if closed_for < self.interval else self.interval
                await asyncio.sleep(pause)
                closed_for += pause
                continue
            closed_for = 0.0
            readable: asyncio.Future[None] = loop.create_future()
            loop.add_reader(fd, _wake, readable)
            try:
                await asyncio.wait_for(readable, self.interval)
            except TimeoutError:
                continue  # the periodic scan read it; look at the fd again (it may have changed)
            finally:
                loop.remove_reader(fd)
            await asyncio.sleep(KMSG_BATCH_SECONDS)
            if self._readers[(node, "kmsg")].busy:  # stuck: the periodic scan counts it
                await asyncio.sleep(self.interval)
                continue
            try:
                await self._scan_source(node, "kmsg", self.clock())
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s: reading the kernel log failed; trying again", node)
                await asyncio.sleep(self.interval)

    async def _probe(self, node: str, now: datetime) -> None:
        marker = self.blackholes.get(node)
        if marker is not None and marker.exists():
            self.probes[node].record(False, "no answer (network partition)", now)
            return
        try:
            await self.bus.request(
                names.node_request(node, names.AgentVerb.INFO),
                NodeInfoRequest(),
                NodeInfoReply,
                timeout=self.probe_timeout,
            )
        except NodusError as error:
            self.probes[node].record(False, str(error), now)
            return
        self.probes[node].record(True, "", now)

    async def _report(
        self, node: str, source: str, findings: list[Finding], malformed: int, now: datetime
    ) -> bool:
        key = names.signal_key(node, source)
        signature = _signature(findings)
        sent = self._sent.get(key)
        if sent is not None and sent[0] == signature and now - sent[1] < self.keepalive:
            return False
        beat = self.health.get(node)
        report = SignalReport(
            node=node,
            source=source,
            observed_time=now,
            findings=findings,
            boot_id=beat.boot_id if beat else "",
            malformed=malformed,
        )
        await self.signals.put(key, report)
        self._sent[key] = (signature, now)
        return True


# -- the daemon ------------------------------------------------------------------------------------


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Run the fault detectors (NVIDIA Xid and PCIe drops in the kernel log, DCGM double-bit "
        "ECC, row remapping and thermal throttling, Node Problem Detector's ReadonlyFilesystem, "
        "InfiniBand port state and link flapping, host reachability) and write what they see "
        "to the bus for the remediator. Either every machine of a local fleet (--state-dir "
        "with --fleet: inputs under STATE_DIR/machines/NAME/) or one machine (--node with the "
        "paths of its inputs)."
    )
    add_common_flags(parser, metrics_port=0)
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=None,
        help="a local fleet's files: each machine's inputs under STATE_DIR/machines/NAME/",
    )
    parser.add_argument(
        "--fleet",
        type=Path,
        default=Path(os.environ.get("NODUS_FLEET", "examples/fleet.yaml")),
        help="the fleet whose machines to monitor with --state-dir (env NODUS_FLEET)",
    )
    parser.add_argument(
        "--simulate",
        action="store_true",
        help="write a healthy machine's files where missing (the local fleet of `nodus up`)",
    )
    parser.add_argument("--node", help="one machine: its name")
    defaults = MachinePaths.system()
    parser.add_argument(
        "--kmsg",
        default=defaults.kmsg,
        help="the kernel log: the record device /dev/kmsg (read as the kernel writes it), or a "
        "kernel log file that grows (e.g. /var/log/kern.log)",
    )
    parser.add_argument(
        "--kmsg-cursor",
        default=None,
        help="with --kmsg /dev/kmsg: the file that keeps the last record read and its boot id "
        "across restarts, so no record is reported twice (default $STATE_DIRECTORY/"
        "kmsg-cursor.json under systemd, else /var/lib/nodus-monitor/kmsg-cursor.json)",
    )
    parser.add_argument("--dcgm", default=defaults.dcgm, help="dcgm-exporter text: file or URL")
    parser.add_argument("--npd", default=defaults.npd, help="Node Problem Detector conditions")
    parser.add_argument("--infiniband", default=defaults.infiniband, help="sysfs infiniband root")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between scans")
    parser.add_argument(
        "--source-timeout",
        type=float,
        default=SOURCE_TIMEOUT_SECONDS,
        help="seconds one source may take to read before a scan goes on without it",
    )
    parser.add_argument(
        "--keepalive", type=float, default=60.0, help="rewrite unchanged reports this often"
    )
    parser.add_argument(
        "--no-reachability", action="store_true", help="do not probe host reachability"
    )
    parser.add_argument("--heartbeat-timeout", type=float, default=HEARTBEAT_TIMEOUT_SECONDS)
    parser.add_argument(
        "--unreachable-seconds",
        type=float,
        default=HEARTBEAT_TIMEOUT_SECONDS,
        help="a machine is unreachable once its agent has not answered for this long (an "
        "agent that restarts or is upgraded is silent for seconds; default: the heartbeat "
        "timeout, as long as the placer waits before it calls a member lost)",
    )


def machines_of(
    args: argparse.Namespace, simulate: Simulate | None = None
) -> tuple[dict[str, MachinePaths], dict[str, Path]]:
    if args.node:
        return {
            args.node: MachinePaths(
                kmsg=args.kmsg,
                dcgm=args.dcgm,
                npd=args.npd,
                infiniband=args.infiniband,
                kmsg_cursor=args.kmsg_cursor or default_kmsg_cursor(),
            )
        }, {}
    if args.state_dir is None:
        raise ValueError("give --state-dir (a local fleet) or --node (one machine)")
    from libs.contracts.fleet import load_fleet

    fleet = load_fleet(args.fleet)
    machines: dict[str, MachinePaths] = {}
    blackholes: dict[str, Path] = {}
    for machine in fleet.machines:
        directory = args.state_dir / "machines" / machine.name
        if args.simulate:
            if simulate is None:
                raise ValueError("--simulate is the lab's: run it as `nodus monitor`")
            simulate(directory, max(1, machine.accelerators.count))
        machines[machine.name] = MachinePaths.under(directory)
        blackholes[machine.name] = directory / BLACKHOLE
    return machines, blackholes


async def _body(
    args: argparse.Namespace, stop: asyncio.Event, simulate: Simulate | None = None
) -> None:
    machines, blackholes = machines_of(args, simulate)
    bus = await Bus.open(
        args.nats,
        name=f"nodus-monitor-{args.node}" if args.node else "nodus-monitor",
        credentials=args.credentials,
        # A machine's own monitor receives replies only on its own inbox (S1).
        inbox_prefix=monitor_inbox(args.node) if args.node else None,
        confined=bool(args.node),
    )
    try:
        if args.node:  # before the buckets: another user is refused them, and would say less
            await check_credentials(bus, args.node)
        for bucket in (names.BUCKET_SIGNALS, names.BUCKET_HEALTH):
            await bus.ensure_bucket(bucket)
    except BaseException:
        await bus.close()
        raise
    monitor = Monitor(
        bus,
        machines,
        interval=args.interval,
        keepalive=args.keepalive,
        reachability=not args.no_reachability,
        heartbeat_timeout=args.heartbeat_timeout,
        unreachable_seconds=args.unreachable_seconds,
        blackholes=blackholes,
        source_timeout=args.source_timeout,
    )
    try:
        await monitor.start()
        # Revalidation asks this machine's monitor to run its detectors now (R15, R18).
        await bus.serve(
            "nodus-monitor",
            VERSION,
            "Detectors of the machines this monitor reads, on demand",
            list(Diagnostics(machines).endpoints()),
        )
        await stop.wait()
    finally:
        await monitor.stop()
        await bus.close()


async def check_credentials(bus: Bus, node: str) -> None:
    """A monitor given another machine's bus user, or its agent's (one seed copied to both
    units, one Kubernetes secret for every pod), could never report what it finds: the bus
    would refuse each report. It does not start, and says why."""
    subject = f"$KV.{names.BUCKET_SIGNALS}.{names.signal_key(node, 'kmsg')}"
    try:
        info = await bus.user_info(timeout=WHO_AM_I_WAIT_MONITOR)
    except NodusError:
        # Every user that may be a machine's monitor may ask and hear the answer on the
        # monitor's inbox; its agent's user may do neither.
        whose = "is not answered who it is on the monitor's own inbox"
    else:
        if may_publish(info, subject):
            return  # its own user, a service's, an operator's, or a bus without authentication
        whose = f"may not write {node}'s signals"
    raise NodusError(
        ErrorCode.UNAUTHORIZED,
        f"monitor of {node!r}: the bus user of --credentials {whose}: it is not {node}'s "
        "monitor user (another machine's, or its agent's), so the bus would refuse every "
        f"report; give it monitor-{node}.nk, which `nodus bus user --agent {node}` writes "
        "beside the agent's seed",
    )


def run(args: argparse.Namespace, simulate: Simulate | None = None) -> int:
    """`simulate`: how `--simulate` writes a lab machine's inputs (handed in by the lab)."""
    if not args.node and args.state_dir is None:
        print("nodus monitor: give --state-dir (a local fleet) or --node (one machine)")
        return 2
    return run_daemon("monitor", args, functools.partial(_body, simulate=simulate))

"""`nodus monitor --kmsg /dev/kmsg` on this machine (issue 22, part 2; R1, O4): the daemon
process against a real nats-server, reading the kernel's record device while this test writes
real records into it as root.

- an Xid 79 line written into /dev/kmsg is an alert within 2 s;
- 10,000 unrelated records in a burst are read without blocking and the Xid after them is seen;
- an Xid logged before the monitor started is reported (the log is read from this boot's first
  record); a restarted monitor does not report a record twice (the cursor: boot id and last
  sequence number) and reads what was logged while it was down; a cursor of another boot is
  ignored;
- DCGM and NPD findings keep arriving while the kernel log is silent, and while another source
  blocks (an NPD path that never answers is skipped and counted; the others go on).

Records carry a random PCI address or token: other records of this kernel's log, and earlier
runs' (they stay in the buffer), never match."""

from __future__ import annotations

import asyncio
import os
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import msgspec
import pytest

from app.lab import faults
from libs.bus import Bus
from libs.bus.server import NatsServer
from libs.contracts import names
from libs.contracts.remediation import Alert, AlertKind, AlertState, KmsgCursor, SignalReport
from services.monitor.detectors.kmsgdevice import read_boot_id
from services.remediator.alerts import alert_id
from tests.e2e.daemon_logs import DaemonLogs
from tests.kmsg_support import (
    MonitorProcess,
    SignalWatch,
    finding_for,
    kmsg_writable,
    random_pci,
    remediation_bus,
    write_record,
    xid_record,
)
from tests.remediation_support import Fleet

pytestmark = pytest.mark.skipif(kmsg_writable() is not None, reason=str(kmsg_writable()))

ALERT_WITHIN = 2.0  # seconds, the bound


def _has(pci: str) -> Callable[[SignalReport], bool]:
    return lambda report: finding_for(report, pci) is not None


@pytest.fixture
async def bus(nats_server: NatsServer) -> AsyncIterator[Bus]:
    """The test's connection, with the remediation buckets (signals, alerts) open."""
    async with remediation_bus(nats_server.url) as opened:
        yield opened


@pytest.fixture
async def machine(tmp_path: Path) -> Path:
    directory = tmp_path / "machine"
    faults.ensure_baseline(directory, gpus=2, ib_ports=1)
    return directory


@pytest.fixture
def node() -> str:
    return f"kmsg-{secrets.token_hex(4)}"


@pytest.fixture
async def watch(bus: Bus, node: str) -> AsyncIterator[SignalWatch]:
    signals = SignalWatch(bus, node)
    await signals.start()
    yield signals
    await signals.stop()


@pytest.fixture
def monitor(
    nats_server: NatsServer, node: str, machine: Path, tmp_path: Path, daemon_logs: DaemonLogs
) -> Iterator[MonitorProcess]:
    logs = tmp_path / "logs"
    logs.mkdir()
    daemon_logs.watch(logs)  # no error or traceback in its log (tests/e2e/conftest.py)
    process = MonitorProcess(nats_server.url, node, machine, logs)
    yield process
    assert process.stop() in (0, None)


async def _started(monitor: MonitorProcess, watch: SignalWatch, npd: str | None = None) -> float:
    """Starts the monitor; returns when its first kernel log report is in (it read the log)."""
    began = time.monotonic()
    monitor.start(npd)
    await watch.until("kmsg", lambda _: True, timeout=30, after=began)
    return began


async def test_an_xid_written_into_dev_kmsg_is_an_alert_within_2_seconds(
    nats_server: NatsServer,
    bus: Bus,
    tmp_path: Path,
    node: str,
    watch: SignalWatch,
    monitor: MonitorProcess,
) -> None:
    fleet = Fleet(nats_server.url, bus, tmp_path / "fleet")
    await fleet.start_remediator()
    try:
        await _started(monitor, watch)
        pci = random_pci()
        aid = alert_id(node, AlertKind.XID, pci, 79)
        alerts = bus.bucket(names.BUCKET_ALERTS, Alert)

        written = time.monotonic()
        write_record(xid_record(pci, 79))
        reported, report = await watch.until("kmsg", _has(pci), timeout=10, after=written)
        deadline = written + 10
        alert = None
        while time.monotonic() < deadline:
            found = await alerts.get(aid)
            if found is not None and found.value.state is AlertState.FIRING:
                alert = found.value
                break
            await asyncio.sleep(0.01)
        alerted = time.monotonic()
    finally:
        await fleet.stop()

    assert alert is not None, f"no alert {aid}"
    assert reported - written < ALERT_WITHIN, f"report after {reported - written:.3f}s"
    assert alerted - written < ALERT_WITHIN, f"alert after {alerted - written:.3f}s"
    finding = finding_for(report, pci)
    assert finding is not None and finding.xid == 79 and finding.severity == "critical"
    # The evidence is the record as the kernel wrote it: prio,seq,usec,flags;message
    assert finding.evidence.where == "/dev/kmsg"
    assert finding.evidence.lines[-1].endswith(
        f"NVRM: Xid (PCI:{pci}): 79, pid=4242, name=python3, GPU has fallen off the bus."
    )
    assert alert.evidence[0].lines == finding.evidence.lines


async def test_a_burst_of_10000_records_is_read_and_the_xid_after_it_is_not_missed(
    node: str, watch: SignalWatch, monitor: MonitorProcess
) -> None:
    await _started(monitor, watch)
    token = secrets.token_hex(6)
    before = monitor.metric("nodus_monitor_kmsg_records_total") + monitor.metric(
        "nodus_monitor_kmsg_missed_records_total"
    )

    began = time.monotonic()
    for index in range(10_000):
        write_record(f"<6>nodus-test burst {token} record {index}: nothing about GPUs")
    pci = random_pci()
    written = time.monotonic()
    write_record(xid_record(pci, 79))
    reported, _ = await watch.until("kmsg", _has(pci), timeout=10, after=began)

    assert reported - written < ALERT_WITHIN, f"reported {reported - written:.3f}s after"

    # Every record of the burst was read, or counted as overwritten before it could be.
    async def accounted() -> float:
        return (
            monitor.metric("nodus_monitor_kmsg_records_total")
            + monitor.metric("nodus_monitor_kmsg_missed_records_total")
            - before
        )

    assert await accounted() >= 10_001
    # The reader never blocked: the other sources were reported meanwhile, none overran.
    assert monitor.metric("nodus_monitor_source_overruns_total", 'source="kmsg"') == 0
    assert monitor.process is not None and monitor.process.poll() is None


async def test_a_restarted_monitor_does_not_report_a_record_twice(
    node: str, watch: SignalWatch, monitor: MonitorProcess
) -> None:
    early = random_pci()
    write_record(xid_record(early, 79))  # before the monitor runs: read from this boot's start
    await _started(monitor, watch)
    first = finding_for(watch.latest("kmsg"), early)
    assert first is not None and first.evidence.values["count"] == 1
    assert monitor.metric("nodus_monitor_kmsg_skipped_records_total") == 0

    assert monitor.stop() == 0
    cursor = msgspec.json.decode(monitor.cursor.read_bytes(), type=KmsgCursor)
    assert cursor.boot_id == read_boot_id()
    down = random_pci()
    write_record(xid_record(down, 79))  # while the monitor is down

    restarted = await _started(monitor, watch)
    report = watch.latest("kmsg")
    again, missed_while_down = finding_for(report, early), finding_for(report, down)
    assert again is not None and missed_while_down is not None
    assert again.evidence.values["count"] == 1, "the same record was counted twice"
    assert again.evidence.observed_time == first.evidence.observed_time
    assert missed_while_down.evidence.values["count"] == 1
    # It skipped everything up to its cursor and read only what came after.
    assert monitor.metric("nodus_monitor_kmsg_skipped_records_total") > 0
    assert monitor.metric("nodus_monitor_kmsg_records_total") < monitor.metric(
        "nodus_monitor_kmsg_skipped_records_total"
    )

    # And it goes on reading what comes next.
    later = random_pci()
    write_record(xid_record(later, 79))
    await watch.until("kmsg", _has(later), timeout=ALERT_WITHIN, after=restarted)


async def test_a_cursor_of_another_boot_is_ignored(
    node: str, watch: SignalWatch, monitor: MonitorProcess
) -> None:
    old = KmsgCursor(boot_id="00000000-0000-0000-0000-000000000000", seq=10**15)
    monitor.cursor.write_bytes(msgspec.json.encode(old))
    pci = random_pci()
    write_record(xid_record(pci, 79))
    await _started(monitor, watch)
    assert finding_for(watch.latest("kmsg"), pci) is not None
    assert monitor.metric("nodus_monitor_kmsg_skipped_records_total") == 0


async def test_dcgm_and_npd_findings_arrive_while_the_kernel_log_is_silent(
    node: str, machine: Path, watch: SignalWatch, monitor: MonitorProcess
) -> None:
    began = await _started(monitor, watch)
    faults.inject(machine, faults.Fault("ecc-dbe", gpu=1))
    faults.inject(machine, faults.Fault("readonly-fs"))
    await watch.until("dcgm", lambda r: bool(r.findings), timeout=5, after=began)
    await watch.until("npd", lambda r: bool(r.findings), timeout=5, after=began)


async def test_a_source_that_blocks_is_skipped_and_the_others_go_on(
    node: str, machine: Path, watch: SignalWatch, monitor: MonitorProcess, tmp_path: Path
) -> None:
    """NPD's path is a FIFO nobody writes: opening it blocks. The kernel log and DCGM are read
    and reported meanwhile; NPD is reported once it answers."""
    fifo = tmp_path / "npd.fifo"
    os.mkfifo(fifo)
    monitor.extra = ["--source-timeout", "0.5"]
    began = await _started(monitor, watch, npd=str(fifo))

    pci = random_pci()
    written = time.monotonic()
    write_record(xid_record(pci, 79))
    reported, _ = await watch.until("kmsg", _has(pci), timeout=10, after=began)
    assert reported - written < ALERT_WITHIN
    faults.inject(machine, faults.Fault("ecc-dbe", gpu=0))
    await watch.until("dcgm", lambda r: bool(r.findings), timeout=5, after=began)
    assert monitor.metric("nodus_monitor_source_overruns_total", 'source="npd"') >= 1
    assert watch.latest("npd") is None

    # NPD answers (the FIFO gets its writer): its finding arrives.
    document = (machine / "npd.json").read_text().replace('"False"', '"True"')
    writer = threading.Thread(target=lambda: fifo.write_text(document), daemon=True)
    writer.start()
    await watch.until("npd", lambda r: bool(r.findings), timeout=10, after=began)
    writer.join(timeout=5)

"""Kernel log bench: how fast `nodus monitor --kmsg /dev/kmsg` turns an Xid into a report, and
how many records per second its reader takes from the kernel, against baselines of the same run.

    .venv/bin/python -m tests.bench.kmsg            # as root: writes records into /dev/kmsg
    .venv/bin/python -m tests.bench.kmsg --quick    # smoke

1. read rate, over the same full kernel log buffer (filled first with filler records):
   - before: the file reader (the monitor's only reader before) given /dev/kmsg, bounded;
   - baseline `raw`: a bare `os.read` loop on /dev/kmsg (open non-blocking, read to EAGAIN);
   - `reader`: the monitor's reader (KmsgDevice: parse, sequence check, Xid detector);
   - `file`: the lab's path, the same records' lines as a kernel log file (MachineDetectors);
2. alert latency: the daemon (`python -m app monitor`) on a real nats-server; an Xid 79 record
   written with a fresh PCI address, until a watch on `nodus-signals` sees the report naming
   it; baseline: a KV put seen by a watch on another connection (the hop the report takes);
3. burst: 10,000 unrelated records written at once, then an Xid: the time until its report,
   and how many of the burst the monitor read or counted as overwritten.

Speed is reported, never asserted: stdout carries one JSON object, progress goes to stderr."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from app.lab import faults
from libs.bus import Bus
from libs.bus.server import NatsServer
from libs.contracts import names
from libs.contracts.remediation import SignalReport
from services.monitor.detectors.kmsg import KernelLog
from services.monitor.detectors.kmsgdevice import KmsgDevice
from services.monitor.detectors.kmsgrecords import MAX_RECORD, parse_record
from services.monitor.detectors.machine import MachineDetectors, MachinePaths
from tests.kmsg_support import (
    KMSG,
    MonitorProcess,
    SignalWatch,
    finding_for,
    kmsg_writable,
    random_pci,
    write_record,
    xid_record,
)


def log(message: str) -> None:
    print(f"[bench] {message}", file=sys.stderr, flush=True)


def quantiles(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {
        "n": len(ordered),
        "mean_ms": round(statistics.fmean(ordered) * 1e3, 3),
        "p50_ms": round(at(0.5) * 1e3, 3),
        "p90_ms": round(at(0.9) * 1e3, 3),
        "max_ms": round(ordered[-1] * 1e3, 3),
    }


# -- 1. read rate ---------------------------------------------------------------------------------


def _fill(records: int) -> None:
    token = secrets.token_hex(4)
    for index in range(records):
        write_record(f"<6>nodus-bench fill {token} {index}: an unrelated kernel message, padded")


def _raw() -> tuple[int, float]:
    fd = os.open(KMSG, os.O_RDONLY | os.O_NONBLOCK)
    count, started = 0, time.perf_counter()
    try:
        while True:
            try:
                os.read(fd, MAX_RECORD)
            except BlockingIOError:
                break
            except BrokenPipeError:
                continue
            count += 1
    finally:
        os.close(fd)
    return count, time.perf_counter() - started


def _reader(tmp: Path) -> tuple[int, float]:
    device = KmsgDevice(KMSG, KernelLog("bench", KMSG), cursor=str(tmp / "cursor.json"))
    (tmp / "cursor.json").unlink(missing_ok=True)
    started = time.perf_counter()
    device.read(datetime.now(UTC))
    elapsed = time.perf_counter() - started
    device.close()
    assert device.caught_up and device.stream is not None
    return device.stream.records, elapsed


def _file(tmp: Path) -> tuple[int, float]:
    """The same records as a kernel log file, read by the lab's path."""
    fd = os.open(KMSG, os.O_RDONLY | os.O_NONBLOCK)
    lines = []
    try:
        while True:
            try:
                lines.append(parse_record(os.read(fd, MAX_RECORD)).line)
            except BlockingIOError:
                break
            except BrokenPipeError:
                continue
    finally:
        os.close(fd)
    machine = tmp / "machine"
    faults.ensure_baseline(machine, gpus=1, ib_ports=1)
    (machine / "kmsg").write_text("\n".join(lines) + "\n")
    detectors = MachineDetectors("bench", MachinePaths.under(machine))
    started = time.perf_counter()
    detectors.scan_source("kmsg", datetime.now(UTC))
    return len(lines), time.perf_counter() - started


def old_path() -> dict[str, Any]:
    """What the file reader (the only reader before) makes of /dev/kmsg: an Xid written first,
    its scan run on a thread for at most 3 s."""
    pci = random_pci()
    write_record(xid_record(pci, 79))
    detectors = MachineDetectors("bench", MachinePaths(KMSG, "/nonexistent", "", ""))
    found: list[bool] = []
    errors: list[str] = []

    def scan() -> None:
        try:
            with open(KMSG, "rb") as file:  # what _scan_kmsg_file does, to see its error
                file.seek(0)
        except OSError as error:
            errors.append(str(error))
        findings = detectors._scan_kmsg_file(datetime.now(UTC))
        found.append(any(f.subject == pci for f in findings))

    thread = threading.Thread(target=scan, daemon=True)
    started = time.perf_counter()
    thread.start()
    thread.join(3.0)
    return {
        "blocked": thread.is_alive(),
        "seconds": round(time.perf_counter() - started, 3),
        "xid_seen": bool(found and found[0]),
        "error": errors[0] if errors else None,
    }


def read_rate(tmp: Path, rounds: int) -> dict[str, Any]:
    _fill(6_000)  # more than the buffer holds: it is full of records like these
    best: dict[str, tuple[int, float]] = {}
    for _ in range(rounds):
        for name, measure in (("raw", _raw), ("reader", lambda: _reader(tmp))):
            count, elapsed = measure()
            rate = count / elapsed
            if name not in best or rate > best[name][0] / best[name][1]:
                best[name] = (count, elapsed)
    best["file"] = _file(tmp)
    result: dict[str, Any] = {"old_file_reader_on_dev_kmsg": old_path()}
    result |= {
        name: {
            "records": count,
            "seconds": round(elapsed, 6),
            "records_per_s": round(count / elapsed),
        }
        for name, (count, elapsed) in best.items()
    }
    raw = result["raw"]["records_per_s"]
    result["ratios"] = {
        "reader_over_raw": round(result["reader"]["records_per_s"] / raw, 3),
        "file_over_raw": round(result["file"]["records_per_s"] / raw, 3),
    }
    return result


# -- 2 and 3. the daemon --------------------------------------------------------------------------


def _numbered(index: int) -> Callable[[SignalReport], bool]:
    return lambda report: report.malformed == index


def _naming(pci: str) -> Callable[[SignalReport], bool]:
    return lambda report: finding_for(report, pci) is not None


async def bus_hop(bus: Bus, other: Bus, samples: int) -> dict[str, float]:
    """A KV put on one connection seen by a watch on another: the report's own hop."""
    node = f"hop-{secrets.token_hex(3)}"
    watch = SignalWatch(other, node)
    await watch.start()
    bucket = bus.bucket(names.BUCKET_SIGNALS, SignalReport)
    took = []
    try:
        for index in range(samples):
            sent = time.monotonic()
            report = SignalReport(
                node=node, source="kmsg", observed_time=datetime.now(UTC), malformed=index
            )
            await bucket.put(names.signal_key(node, "kmsg"), report)
            at, _ = await watch.until("kmsg", _numbered(index), 5, sent)
            took.append(at - sent)
    finally:
        await watch.stop()
    return quantiles(took)


async def alert_latency(watch: SignalWatch, samples: int, gap: float) -> list[float]:
    took = []
    for _ in range(samples):
        pci = random_pci()
        written = time.monotonic()
        write_record(xid_record(pci, 79))
        at, _ = await watch.until("kmsg", _naming(pci), 10, written)
        took.append(at - written)
        await asyncio.sleep(gap)
    return took


async def burst(watch: SignalWatch, monitor: MonitorProcess, records: int) -> dict[str, Any]:
    def accounted() -> float:
        return monitor.metric("nodus_monitor_kmsg_records_total") + monitor.metric(
            "nodus_monitor_kmsg_missed_records_total"
        )

    before_read = monitor.metric("nodus_monitor_kmsg_records_total")
    before_missed = monitor.metric("nodus_monitor_kmsg_missed_records_total")
    before_epipe = monitor.metric("nodus_monitor_kmsg_overwritten_total")
    token = secrets.token_hex(4)
    began = time.monotonic()
    for index in range(records):
        write_record(f"<6>nodus-bench burst {token} {index}: nothing about GPUs")
    written = time.monotonic()
    pci = random_pci()
    write_record(xid_record(pci, 79))
    at, _ = await watch.until("kmsg", lambda r: finding_for(r, pci) is not None, 30, began)
    read = monitor.metric("nodus_monitor_kmsg_records_total") - before_read
    missed = monitor.metric("nodus_monitor_kmsg_missed_records_total") - before_missed
    return {
        "records": records,
        "write_seconds": round(written - began, 3),
        "written_per_s": round(records / (written - began)),
        "xid_after_burst_ms": round((at - written) * 1e3, 3),
        "read": int(read),
        "overwritten_unread": int(missed),
        "epipe": int(monitor.metric("nodus_monitor_kmsg_overwritten_total") - before_epipe),
        "accounted": accounted() - before_read - before_missed >= records + 1,
    }


async def daemon(tmp: Path, opts: argparse.Namespace) -> dict[str, Any]:
    server = NatsServer(tmp / "nats").start()
    os.environ["NODUS_CREDENTIALS"] = server.credentials or ""
    buckets = [names.BUCKET_SIGNALS, names.BUCKET_HEALTH]
    bus = await Bus.open(server.url, name="bench", buckets=buckets)
    other = await Bus.open(server.url, name="bench-watch", buckets=buckets)
    machine = tmp / "machine"
    faults.ensure_baseline(machine, gpus=1, ib_ports=1)
    node = f"bench-{secrets.token_hex(3)}"
    monitor = MonitorProcess(server.url, node, machine, tmp / "logs")
    watch = SignalWatch(other, node)
    try:
        log("baseline: the bus hop of a report")
        hop = await bus_hop(bus, other, opts.samples * 2)
        await watch.start()
        started = time.monotonic()
        monitor.start()
        await watch.until("kmsg", lambda _: True, 60, started)
        start_s = time.monotonic() - started
        log(f"alert latency: {opts.samples} Xid records")
        latency = quantiles(await alert_latency(watch, opts.samples, opts.gap))
        log(f"burst: {opts.burst} records, then an Xid")
        burst_result = await burst(watch, monitor, opts.burst)
        overruns = monitor.metric("nodus_monitor_source_overruns_total", 'source="kmsg"')
    finally:
        await watch.stop()
        monitor.stop()
        await bus.close()
        await other.close()
        server.stop()
    return {
        "monitor_start_to_first_report_s": round(start_s, 3),
        "bus_hop": hop,
        "alert_latency": latency,
        "alert_over_bus_hop_p50": round(latency["p50_ms"] / hop["p50_ms"], 2),
        "burst": burst_result,
        "kmsg_overruns": overruns,
    }


async def run(opts: argparse.Namespace) -> dict[str, Any]:
    reason = kmsg_writable()
    if reason is not None:
        return {"error": reason}
    result: dict[str, Any] = {
        "params": {"samples": opts.samples, "burst": opts.burst, "rounds": opts.rounds},
        "host": {
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "kernel": platform.release(),
        },
    }
    with tempfile.TemporaryDirectory(prefix="nodus-bench-kmsg-") as name:
        tmp = Path(name)
        log("read rate: raw os.read, the monitor's reader, the lab's file path")
        result["read_rate"] = read_rate(tmp, opts.rounds)
        result.update(await daemon(tmp, opts))
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--samples", type=int, default=50, help="Xid records timed one by one")
    parser.add_argument("--gap", type=float, default=0.1, help="seconds between those records")
    parser.add_argument("--burst", type=int, default=10_000, help="records written at once")
    parser.add_argument("--rounds", type=int, default=5, help="read-rate rounds (best kept)")
    parser.add_argument("--quick", action="store_true", help="10 samples, 2 rounds")
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.samples, opts.rounds = 10, 2
    return opts


def main() -> int:
    result = asyncio.run(run(parse_args()))
    print(json.dumps(result, indent=2))
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())

"""The kernel log reader against this machine's real /dev/kmsg (kmsgdevice.py): records
overwritten before they were read are an EPIPE that is counted and survived; a new boot id
starts over from this boot's first record; a bounded read leaves the rest for the next one; a
cursor that cannot be written costs a warning, never the reader. Root only: records are written
into the kernel's log."""

from __future__ import annotations

import secrets
from datetime import UTC, datetime
from pathlib import Path

import msgspec
import pytest

from libs.contracts.remediation import KmsgCursor
from services.monitor.detectors.kmsg import KernelLog
from services.monitor.detectors.kmsgdevice import KmsgDevice, read_boot_id
from services.monitor.detectors.machine import MachineDetectors, MachinePaths
from tests.kmsg_support import KMSG, kmsg_writable, random_pci, write_record, xid_record

pytestmark = pytest.mark.skipif(kmsg_writable() is not None, reason=str(kmsg_writable()))


def _now() -> datetime:
    return datetime.now(UTC)


def _pcis(log: KernelLog) -> set[str]:
    return {f.subject for f in log.findings(_now())}


def _device(tmp_path: Path, boot_id: str | None = None, max_records: int = 50_000) -> KmsgDevice:
    """A reader whose boot id is a file the test writes (a new one is a reboot)."""
    boot = tmp_path / "boot_id"
    boot.write_text((boot_id or read_boot_id()) + "\n")
    log = KernelLog("gpu-1", KMSG)
    cursor = str(tmp_path / "cursor.json")
    return KmsgDevice(KMSG, log, cursor, str(boot), max_records=max_records)


def test_records_overwritten_before_they_are_read_are_counted_and_survived(
    tmp_path: Path,
) -> None:
    device = _device(tmp_path)
    device.read(_now())  # caught up: the next record is the first we have not read
    assert device.caught_up
    token = secrets.token_hex(6)
    # More than a 128 KiB log holds (and than its ~4,000 record slots), unread meanwhile.
    filler = "x" * 100
    for index in range(6_000):
        write_record(f"<6>nodus-test overwrite {token} {index} {filler}")
    pci = random_pci()
    write_record(xid_record(pci, 79))
    assert device.stream is not None
    before = device.stream.last_seq
    device.read(_now())
    assert device.caught_up
    assert device.overwritten >= 1, "no EPIPE: the log held every record?"
    assert device.stream.missed > 0
    assert device.stream.last_seq is not None and before is not None
    assert device.stream.records + device.stream.missed >= 6_001
    assert pci in _pcis(device.kernel_log)
    device.close()


def test_a_new_boot_starts_over_and_the_same_boot_resumes(tmp_path: Path) -> None:
    pci = random_pci()
    write_record(xid_record(pci, 79))
    first = _device(tmp_path, boot_id="boot-one")
    first.read(_now())
    first.close()
    assert pci in _pcis(first.kernel_log)
    saved = msgspec.json.decode((tmp_path / "cursor.json").read_bytes(), type=KmsgCursor)
    assert saved.boot_id == "boot-one"

    same = _device(tmp_path, boot_id="boot-one")
    same.read(_now())
    same.close()
    assert same.stream is not None and same.stream.records < 50  # only what came since
    assert pci in _pcis(same.kernel_log)  # restored, not read again

    other = _device(tmp_path, boot_id="boot-two")
    other.read(_now())
    other.close()
    assert other.stream is not None and other.stream.skipped == 0  # from the start of the log
    assert pci in _pcis(other.kernel_log)  # found again, by reading


def test_a_bounded_read_leaves_the_rest_for_the_next(tmp_path: Path) -> None:
    pci = random_pci()
    write_record(xid_record(pci, 79))
    device = _device(tmp_path, max_records=10)
    device.read(_now())
    assert not device.caught_up
    for _ in range(10_000):
        if device.caught_up:
            break
        device.read(_now())
    assert device.caught_up
    assert pci in _pcis(device.kernel_log)
    device.close()


def test_a_cursor_that_cannot_be_written_costs_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("a file where the cursor's directory should be")
    log = KernelLog("gpu-1", KMSG)
    device = KmsgDevice(KMSG, log, str(blocked / "cursor.json"))
    pci = random_pci()
    write_record(xid_record(pci, 79))
    device.read(_now())
    device.read(_now())
    device.close()
    assert pci in _pcis(log)
    warnings = [r for r in caplog.records if "cannot keep the kernel log cursor" in r.message]
    assert len(warnings) == 1


def test_the_machine_reads_the_device_as_a_device_and_a_file_as_a_file(tmp_path: Path) -> None:
    pci = random_pci()
    write_record(xid_record(pci, 79))
    paths = MachinePaths.under(tmp_path)
    device = MachineDetectors("gpu-1", MachinePaths(KMSG, paths.dcgm, paths.npd, paths.infiniband))
    found = device.scan_source("kmsg", _now())
    assert device.kmsg_fileno() is not None
    assert any(f.subject == pci for f in found)
    device.close()

    (tmp_path / "kmsg").write_text(f"[ 1.0] {xid_record(pci, 79)[3:]}\n")
    lab = MachineDetectors("gpu-1", paths)
    assert [f.subject for f in lab.scan_source("kmsg", _now())] == [pci]
    assert lab.kmsg_fileno() is None

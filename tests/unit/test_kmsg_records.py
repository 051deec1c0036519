"""/dev/kmsg records, sans-I/O (kmsgrecords.py): the record format with its continuation lines,
sequence numbers that skip what was read and count what was lost, and any bytes at all dropped
and counted, never raised (S3). The detector's state survives a restart (snapshot/restore);
a source read on its own thread is bounded (sourcereader.py)."""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import UTC, datetime, timedelta

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libs.contracts.remediation import AlertKind, KmsgCursor, SeenEvent
from services.monitor.detectors.kmsg import KernelLog
from services.monitor.detectors.kmsgrecords import (
    MAX_RECORD,
    KmsgRecord,
    KmsgStream,
    MalformedRecord,
    parse_record,
)
from services.monitor.sourcereader import Overrun, SourceReader

T0 = datetime(2025, 1, 1, tzinfo=UTC)
XID = b"NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=python3, GPU has fallen off the bus."


def test_a_record_with_its_header_message_and_continuation_lines() -> None:
    record = parse_record(
        b"3,1234,5678901234,-,caller=T42;" + XID + b"\n SUBSYSTEM=pci\n DEVICE=+pci:0000:3b:00.0\n"
    )
    assert (record.facility, record.level, record.seq, record.usec) == (0, 3, 1234, 5678901234)
    assert record.flags == "-"
    assert record.message == XID.decode()
    assert record.fields == {"SUBSYSTEM": "pci", "DEVICE": "+pci:0000:3b:00.0"}
    # The line the detectors parse: the kmsg form without the caller field.
    assert record.line == "3,1234,5678901234,-;" + XID.decode()


def test_a_record_written_from_user_space_has_the_user_facility() -> None:
    record = parse_record(b"11,7,100,-;NVRM: hello\\x0aescaped\n")
    assert (record.facility, record.level) == (1, 3)
    assert record.message == "NVRM: hello\\x0aescaped"  # the kernel escapes; kept as written


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"no header at all\n",
        b"6,1,2;too few fields\n",
        b"x,1,2,-;priority\n",
        b"6,-1,2,-;sequence\n",
        b"6,1,2.5,-;timestamp\n",
        b"9999,1,2,-;priority out of range\n",
        b"6,1,2,-;message\nnot a continuation\n",
        b"6,1,2,-;message\n =no key\n",
        b"6,1,2,-;message\n KEYWITHOUTVALUE\n",
        b"6,123456789012345678901,2,-;seq too long\n",
        b"6,1,2,-;" + b"x" * MAX_RECORD,
    ],
)
def test_malformed_records_raise_malformed(data: bytes) -> None:
    with pytest.raises(MalformedRecord):
        parse_record(data)


def test_the_stream_skips_what_was_read_and_counts_what_was_lost() -> None:
    stream = KmsgStream("boot-a", last_seq=10)
    assert stream.feed(b"6,9,1,-;old\n") is None
    assert stream.feed(b"6,10,1,-;old\n") is None
    assert stream.feed(b"6,11,1,-;new\n") is not None
    assert stream.feed(b"6,15,1,-;after a gap\n") is not None  # 12..14 overwritten unread
    assert stream.feed(b"garbage") is None
    assert (stream.records, stream.skipped, stream.missed, stream.malformed) == (2, 2, 3, 1)
    assert stream.last_seq == 15


def test_a_fresh_stream_counts_the_records_of_this_boot_it_never_saw() -> None:
    stream = KmsgStream("boot-a")
    assert stream.feed(b"6,100,1,-;the oldest record left\n") is not None
    assert stream.missed == 100  # 0..99 overwritten before anyone read them


_TEXT = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\n"), max_size=200)


@settings(max_examples=300, deadline=None)
@given(
    priority=st.integers(0, 0x7FF),
    seq=st.integers(0, 2**64 - 1),
    usec=st.integers(0, 2**64 - 1),
    message=_TEXT,
    fields=st.dictionaries(
        st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZ_", min_size=1, max_size=12),
        _TEXT,
        max_size=3,
    ),
    caller=st.booleans(),
)
def test_well_formed_records_parse_back(
    priority: int, seq: int, usec: int, message: str, fields: dict[str, str], caller: bool
) -> None:
    head = f"{priority},{seq},{usec},-" + (",caller=T1" if caller else "")
    text = head + ";" + message + "\n" + "".join(f" {k}={v}\n" for k, v in fields.items())
    record = parse_record(text.encode())
    assert record == KmsgRecord(priority, seq, usec, "-", message, fields)


@settings(max_examples=500, deadline=None)
@given(st.lists(st.binary(max_size=300), max_size=20))
def test_any_bytes_are_a_record_or_a_counted_drop(reads: list[bytes]) -> None:
    stream = KmsgStream("boot")
    log = KernelLog("gpu-1", "/dev/kmsg")
    taken = 0
    for data in reads:
        record = stream.feed(data)
        if record is not None:
            taken += 1
            log.feed_line(record.line, T0)
    assert stream.records == taken
    assert stream.records + stream.skipped + stream.malformed == len(reads)
    log.findings(T0)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 2047), st.integers(0, 10**6), _TEXT, st.binary(max_size=64))
def test_xid_like_records_with_junk_never_crash(
    priority: int, seq: int, tail: str, junk: bytes
) -> None:
    data = f"{priority},{seq},1,-;NVRM: Xid (PCI:0000:3b:00): {tail}".encode() + junk
    stream = KmsgStream("boot")
    log = KernelLog("gpu-1", "/dev/kmsg")
    record = stream.feed(data)
    if record is not None:
        log.feed_line(record.line, T0)
    assert len(log.findings(T0)) <= 1


def test_what_the_detector_found_survives_a_restart_through_the_cursor() -> None:
    before = KernelLog("gpu-1", "/dev/kmsg")
    before.feed_line("3,5,1000000,-;" + XID.decode(), T0)
    before.feed_line("3,6,2000000,-;NVRM: Xid (PCI:0000:3b:00): 13, pid=1, name=x, SM", T0)
    cursor = KmsgCursor(boot_id="b", seq=6, seen=before.snapshot())
    data = msgspec.json.encode(cursor)

    after = KernelLog("gpu-1", "/dev/kmsg")
    after.restore(msgspec.json.decode(data, type=KmsgCursor).seen)
    assert after.findings(T0) == before.findings(T0)
    # A transient fault restored still expires on the time it was last seen.
    later = T0 + timedelta(hours=1)
    assert [f.xid for f in after.findings(later)] == [79]


def test_a_cursor_file_of_an_older_version_or_junk_is_refused() -> None:
    with pytest.raises(msgspec.DecodeError):
        msgspec.json.decode(b'{"boot_id": 1}', type=KmsgCursor)
    event = SeenEvent(
        kind=AlertKind.XID, subject="s", detail="d", line="l", first=T0, last=T0, count=1
    )
    assert msgspec.json.decode(msgspec.json.encode([event]), type=list[SeenEvent]) == [event]


# -- a source on its own thread, bounded ----------------------------------------------------------


async def test_a_source_that_blocks_overruns_and_its_late_answer_is_kept() -> None:
    release = threading.Event()
    reader: SourceReader[str] = SourceReader("test-stuck")
    other: SourceReader[str] = SourceReader("test-other")

    def stuck() -> str:
        release.wait(10)
        return "late"

    started = time.monotonic()
    with pytest.raises(Overrun):
        await reader.read(stuck, 0.2)
    assert time.monotonic() - started < 1.0
    assert await other.read(lambda: "fine", 0.2) == "fine"  # the others go on
    with pytest.raises(Overrun):  # still stuck: no second read of the same source
        await reader.read(lambda: "second", 0.2)
    release.set()
    for _ in range(100):
        if not reader.busy:
            break
        await asyncio.sleep(0.01)
    assert await reader.read(lambda: "next", 0.2) == "late"  # the freshest there is
    assert await reader.read(lambda: "next", 0.2) == "next"
    reader.close()
    other.close()


async def test_a_source_error_reaches_the_caller() -> None:
    reader: SourceReader[str] = SourceReader("test-error")

    def broken() -> str:
        raise OSError("disk on fire")

    with pytest.raises(OSError, match="disk on fire"):
        await reader.read(broken, 1.0)
    reader.close()

"""`/dev/kmsg` records, sans-I/O (the kernel's Documentation/ABI/testing/dev-kmsg).

Each read() of the device returns one whole record:

    6,1234,5678901234,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1, GPU has fallen off the bus.
     SUBSYSTEM=pci
     DEVICE=+pci:0000:3b:00.0

`prio,seq,usec,flags[,more...];message` on the first line (prio = facility << 3 | level; `more`
is e.g. `caller=T123` on kernels built with CONFIG_PRINTK_CALLER; the message has its
non-printable bytes escaped as `\\xNN`, so it is one line), then zero or more continuation lines,
each a space and `KEY=value`. Sequence numbers grow by one per record within a boot; a gap means
records were overwritten before they were read.

`parse_record` turns one read's bytes into a `KmsgRecord` or raises `MalformedRecord`;
`KmsgStream` keeps which records are new (the last sequence number of a boot, kept across
monitor restarts by the caller) and counts what it drops (S3) and what the kernel lost."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

MAX_RECORD = 16384  # bytes of one read; the kernel formats a record into at most 8 KiB


class MalformedRecord(ValueError):
    """Bytes that are not one /dev/kmsg record."""


@dataclass(frozen=True, slots=True)
class KmsgRecord:
    priority: int  # facility << 3 | level
    seq: int
    usec: int  # since boot, the kernel's clock
    flags: str  # `-`, or `c` / `+` on old kernels' continuation fragments
    message: str
    fields: dict[str, str] = field(default_factory=dict)  # continuation lines, KEY=value

    @property
    def facility(self) -> int:
        return self.priority >> 3

    @property
    def level(self) -> int:
        return self.priority & 7

    @property
    def line(self) -> str:
        """The record's first line as the device wrote it (without any `caller=` field): the
        form the kernel-log detectors parse and show as evidence."""
        return f"{self.priority},{self.seq},{self.usec},{self.flags};{self.message}"


# prio,seq,usec,flags[,more...]; : one match instead of splitting and checking each field.
_HEADER = re.compile(r"(\d{1,20}),(\d{1,20}),(\d{1,20}),([^,;\n]{0,8})(?:,[^;\n]*)?;", re.ASCII)


def parse_record(data: bytes) -> KmsgRecord:
    """One read()'s bytes as a record; raises MalformedRecord for anything else."""
    if not data:
        raise MalformedRecord("empty read")
    if len(data) > MAX_RECORD:
        raise MalformedRecord(f"record of {len(data)} bytes")
    text = data.decode("utf-8", errors="replace")
    header = _HEADER.match(text)
    if header is None:
        raise MalformedRecord(f"no prio,seq,usec,flags; header: {text[:48]!r}")
    prio, seq, usec, flags = header.groups()
    priority = int(prio)
    if priority > 0x7FF:  # 8 bits of facility, 3 of level
        raise MalformedRecord(f"priority {priority} out of range")
    if not flags.isprintable():
        raise MalformedRecord(f"flags {flags!r}")
    message, newline, rest = text[header.end() :].partition("\n")
    fields: dict[str, str] = {}
    if newline and rest:
        for extra in rest.split("\n"):
            if not extra:
                continue
            key, equals, value = extra[1:].partition("=")
            if not extra.startswith(" ") or not equals or not key:
                raise MalformedRecord(f"continuation line {extra[:64]!r} is not ' KEY=value'")
            fields[key] = value
    return KmsgRecord(priority, int(seq), int(usec), flags, message, fields)


@dataclass(slots=True)
class KmsgStream:
    """Which records of one boot are new. `last_seq` is the last record taken (None: nothing
    of this boot yet, the first record in the buffer is the start); records at or before it
    are skipped (a restarted reader sees them again), a jump past it is counted as missed."""

    boot_id: str
    last_seq: int | None = None
    records: int = 0  # taken
    skipped: int = 0  # seen before (at or before last_seq)
    missed: int = 0  # sequence numbers never read: overwritten first
    malformed: int = 0

    def feed(self, data: bytes) -> KmsgRecord | None:
        """One read()'s bytes: the record when it is new, else None (and counted)."""
        try:
            record = parse_record(data)
        except MalformedRecord:
            self.malformed += 1
            return None
        return self.take(record)

    def take(self, record: KmsgRecord) -> KmsgRecord | None:
        if self.last_seq is not None and record.seq <= self.last_seq:
            self.skipped += 1
            return None
        expected = 0 if self.last_seq is None else self.last_seq + 1
        self.missed += record.seq - expected
        self.last_seq = record.seq
        self.records += 1
        return record

"""The kernel log read as the kernel writes it: `/dev/kmsg`, the record device (O4, R1).

Thin I/O around `kmsgrecords` (the sans-I/O parser) and `KernelLog` (the Xid detector):

- opened O_RDONLY|O_NONBLOCK, so a read never waits for the next message: EAGAIN means caught up;
- one record per read(), into a buffer larger than any record the kernel formats;
- the first read after open returns the oldest record still buffered, which is this boot's
  (the buffer does not survive a reboot): an Xid logged before the monitor started is read;
- EPIPE means records were overwritten before we read them: counted, and the next read goes on
  from the oldest record left;
- a cursor file keeps the boot id (`/proc/sys/kernel/random/boot_id`), the last sequence number
  read and what the detector had made of the records so far, so a restarted monitor skips what
  it already read and does not report it twice; a cursor of another boot is ignored.

Each `read()` is bounded (records and seconds) so a log that never stops growing still lets
the monitor report; what is left is read next time."""

from __future__ import annotations

import errno
import logging
import os
import stat
import tempfile
import time
from datetime import datetime, timedelta
from pathlib import Path

import msgspec

from libs.contracts.remediation import KmsgCursor
from services.monitor import metrics
from services.monitor.detectors.kmsg import MAX_LINE, KernelLog, may_matter
from services.monitor.detectors.kmsgrecords import MAX_RECORD, KmsgStream

log = logging.getLogger("nodus.monitor.kmsg")

BOOT_ID = "/proc/sys/kernel/random/boot_id"
MAX_RECORDS_PER_READ = 50_000  # far more than the buffer holds (a 128 KiB log holds ~4,000)
MAX_SECONDS_PER_READ = 0.5
CURSOR_SECONDS = 5.0


def is_record_device(path: str) -> bool:
    """`/dev/kmsg` (or a node made like it): a character device, not a file that grows."""
    try:
        return stat.S_ISCHR(os.stat(path).st_mode)
    except OSError:
        return False


def read_boot_id(path: str = BOOT_ID) -> str:
    with open(path) as file:
        return file.read().strip()


def _monotonic_seconds() -> float:
    # The kernel stamps records with its local clock since boot, which CLOCK_MONOTONIC tracks.
    return time.clock_gettime(time.CLOCK_MONOTONIC)


class KmsgDevice:
    """One open /dev/kmsg feeding one KernelLog; not thread-safe (one reader at a time)."""

    def __init__(
        self,
        path: str,
        kernel_log: KernelLog,
        cursor: str | None = None,
        boot_id_path: str = BOOT_ID,
        max_records: int = MAX_RECORDS_PER_READ,
        max_seconds: float = MAX_SECONDS_PER_READ,
    ) -> None:
        self.path = path
        self.kernel_log = kernel_log
        self.cursor_path = cursor
        self.boot_id_path = boot_id_path
        self.max_records = max_records
        self.max_seconds = max_seconds
        self.stream: KmsgStream | None = None
        self.overwritten = 0  # EPIPE returns
        self.caught_up = False  # the last read ended on EAGAIN
        self._fd: int | None = None
        self._saved_seq: int | None = None
        self._saved_events = 0
        self._saved_at = 0.0
        self._cursor_warned = False
        self._counted = (0, 0, 0)  # records, missed, skipped already in the metrics

    def fileno(self) -> int | None:
        return self._fd

    @property
    def malformed(self) -> int:
        return self.stream.malformed if self.stream else 0

    def open(self) -> None:
        boot_id = read_boot_id(self.boot_id_path)
        fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            os.lseek(fd, 0, os.SEEK_SET)  # the oldest record buffered (this boot's first left)
        except OSError:
            pass  # the device starts there anyway
        self._fd = fd
        if self.stream is not None and self.stream.boot_id == boot_id:
            return  # reopened after an error: go on after the last record taken
        self.stream = KmsgStream(boot_id)
        self._counted = (0, 0, 0)
        self.kernel_log.reset()
        cursor = self._load_cursor()
        if cursor is not None and cursor.boot_id == boot_id:
            self.stream.last_seq = cursor.seq
            self._saved_seq = cursor.seq
            self.kernel_log.restore(cursor.seen)
            log.info("%s: resuming boot %s after record %d", self.path, boot_id, cursor.seq)
        elif cursor is not None:
            log.info("%s: a new boot (%s); reading its log from the start", self.path, boot_id)
        self._saved_events = self.kernel_log.events

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def read(self, now: datetime) -> None:
        """Reads what the kernel logged since the last read (bounded), into the KernelLog."""
        if self._fd is None:
            self.open()
        assert self._fd is not None and self.stream is not None
        stream, fd = self.stream, self._fd
        self.caught_up = False
        try:
            self._drain(fd, stream, now, time.monotonic() + self.max_seconds)
        finally:
            self._count()
            self._save_cursor()

    def _drain(self, fd: int, stream: KmsgStream, now: datetime, deadline: float) -> None:
        clock = _monotonic_seconds()
        for count in range(self.max_records):
            try:
                data = os.read(fd, MAX_RECORD)
            except BlockingIOError:
                self.caught_up = True
                return
            except BrokenPipeError:
                # Overwritten before we read them; the device moved us to the oldest left.
                self.overwritten += 1
                metrics.KMSG_OVERWRITTEN.inc()
                continue
            except OSError as error:
                self.close()  # reopened at the next read, resuming after what was read
                if error.errno != errno.EINVAL:
                    raise
                log.warning("%s: a record larger than %d bytes; reopening", self.path, MAX_RECORD)
                return
            if not data:
                self.caught_up = True
                return
            record = stream.feed(data)
            if record is not None and (may_matter(record.message) or len(data) > MAX_LINE):
                # When the kernel logged it, so a transient fault read late expires on time.
                age = max(0.0, clock - record.usec / 1e6)
                self.kernel_log.feed_line(record.line, now - timedelta(seconds=age))
            if count % 256 == 255 and time.monotonic() > deadline:
                return

    def _count(self) -> None:
        assert self.stream is not None
        now = (self.stream.records, self.stream.missed, self.stream.skipped)
        metrics.KMSG_RECORDS.inc(now[0] - self._counted[0])
        metrics.KMSG_MISSED.inc(now[1] - self._counted[1])
        metrics.KMSG_SKIPPED.inc(now[2] - self._counted[2])
        self._counted = now

    # -- the cursor file ----------------------------------------------------------------------

    def _load_cursor(self) -> KmsgCursor | None:
        if not self.cursor_path:
            return None
        try:
            data = Path(self.cursor_path).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as error:
            log.warning("cannot read the kernel log cursor %s: %s", self.cursor_path, error)
            return None
        try:
            return msgspec.json.decode(data, type=KmsgCursor)
        except msgspec.DecodeError as error:
            metrics.MALFORMED_INPUTS.labels("kmsg-cursor").inc()
            log.warning("ignoring a malformed kernel log cursor %s: %s", self.cursor_path, error)
            return None

    def _save_cursor(self) -> None:
        stream = self.stream
        if not self.cursor_path or stream is None or stream.last_seq is None:
            return
        if stream.last_seq == self._saved_seq:
            return
        # A new fault is saved at once (a restart must not report it twice); records that said
        # nothing are saved at most every CURSOR_SECONDS (a restart reads those few again).
        events = self.kernel_log.events
        if events == self._saved_events and time.monotonic() - self._saved_at < CURSOR_SECONDS:
            return
        cursor = KmsgCursor(
            boot_id=stream.boot_id, seq=stream.last_seq, seen=self.kernel_log.snapshot()
        )
        path = Path(self.cursor_path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
            try:
                with os.fdopen(fd, "wb") as file:
                    file.write(msgspec.json.encode(cursor))
                os.replace(tmp, path)  # a reader (the next monitor) never sees half of one
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as error:
            if not self._cursor_warned:  # once: a restart will read this boot's log again
                log.warning("cannot keep the kernel log cursor at %s: %s", path, error)
                self._cursor_warned = True
            return
        self._saved_seq = stream.last_seq
        self._saved_events = events
        self._saved_at = time.monotonic()

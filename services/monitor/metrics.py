"""The monitor's metrics (prefix `nodus_monitor_`; the malformed-input counter keeps the name
it had when the monitor ran beside the remediator, which dashboards and alerts read)."""

from __future__ import annotations

from prometheus_client import Counter, Histogram

MALFORMED_INPUTS = Counter(
    "nodus_remediator_malformed_inputs_total",
    "Detector inputs skipped as malformed (S3)",
    ["detector"],
)
KMSG_RECORDS = Counter(
    "nodus_monitor_kmsg_records_total", "Kernel log records read from /dev/kmsg (new ones)"
)
KMSG_SKIPPED = Counter(
    "nodus_monitor_kmsg_skipped_records_total",
    "Kernel log records skipped as read before (by this monitor before a restart)",
)
KMSG_OVERWRITTEN = Counter(
    "nodus_monitor_kmsg_overwritten_total",
    "Reads of /dev/kmsg that found records overwritten before they were read (EPIPE)",
)
KMSG_MISSED = Counter(
    "nodus_monitor_kmsg_missed_records_total",
    "Kernel log records of this boot never read: overwritten first (sequence number gaps)",
)
SOURCE_SECONDS = Histogram(
    "nodus_monitor_source_read_seconds",
    "Time to read one detector source of one machine",
    ["source"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
SOURCE_OVERRUNS = Counter(
    "nodus_monitor_source_overruns_total",
    "Scans that skipped a source still reading past its bound (the other sources went on)",
    ["source"],
)

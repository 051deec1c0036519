"""What each signal means and the lightest action that fixes it (R2, R4, R12).

Xid codes follow NVIDIA's catalog of Xid errors and its recommended resolutions: application
errors need no repair of the node (restart the job), GPU resets are done here by rebooting the
machine, a GPU that fell off the bus needs the GPU to lose power (a host power cycle), and
memory that can no longer be remapped is hardware (new hardware: migrate). Summaries are stable
strings: the same in the CLI, the API and notifications."""

from __future__ import annotations

import re
from dataclasses import dataclass

from libs.contracts.remediation import Action, AlertKind, Severity


@dataclass(frozen=True, slots=True)
class XidEntry:
    code: int
    name: str
    severity: Severity
    action: Action
    meaning: str
    transient: bool = False  # an application error: its alert clears on its own
    # R17: the GPU the ranks run on is gone until the repair (a reset or power loss, or
    # memory it can no longer trust); a running gang's member is lost at once.
    breaks_workload: bool = False


def _app(code: int, name: str, meaning: str) -> XidEntry:
    return XidEntry(code, name, "info", Action.NONE, meaning, transient=True)


XID_CATALOG: dict[int, XidEntry] = {
    entry.code: entry
    for entry in [
        _app(
            13,
            "Graphics Engine Exception",
            "usually an application error (out-of-range access, illegal instruction); restart "
            "the job, the node needs no repair",
        ),
        _app(
            31,
            "GPU memory page fault",
            "an application accessed memory it does not own; restart the job, the node needs "
            "no repair",
        ),
        _app(
            32,
            "Invalid or corrupted push buffer stream",
            "the driver saw a corrupted command stream, usually from the application; restart "
            "the job",
        ),
        _app(
            43,
            "GPU stopped processing",
            "a channel of the application was reset after an error; restart the job, the node "
            "needs no repair",
        ),
        _app(
            45,
            "Preemptive cleanup, due to previous errors",
            "the driver cleaned up channels after earlier errors; look at the Xid before it",
        ),
        _app(68, "NVDEC0 Exception", "a video decoder error of the application; restart the job"),
        _app(69, "Graphics Engine class error", "an application error; restart the job"),
        _app(
            109,
            "Context Switch Timeout",
            "a context did not switch in time, mostly an application problem; restart the job",
        ),
        XidEntry(
            48,
            "Double Bit ECC Error",
            "critical",
            Action.REBOOT,
            "an uncorrectable double-bit error in GPU memory; the GPU must be reset (the machine "
            "is rebooted) so the bad memory is retired or remapped",
            breaks_workload=True,
        ),
        XidEntry(
            61,
            "Internal micro-controller breakpoint/warning",
            "critical",
            Action.REBOOT,
            "the GPU's internal micro-controller stopped; a GPU reset (reboot) recovers it",
            breaks_workload=True,
        ),
        XidEntry(
            62,
            "Internal micro-controller halt",
            "critical",
            Action.REBOOT,
            "the GPU's internal micro-controller halted; a GPU reset (reboot) recovers it",
            breaks_workload=True,
        ),
        XidEntry(
            63,
            "ECC page retirement or row remapping recording event",
            "info",
            Action.NONE,
            "the driver recorded a page retirement or row remap; nothing to repair",
            transient=True,
        ),
        XidEntry(
            64,
            "ECC page retirement or row remapper recording failure",
            "critical",
            Action.REBOOT,
            "the driver could not record a page retirement or row remap; reset the GPU (reboot), "
            "and if it recurs the GPU needs replacing",
            breaks_workload=True,
        ),
        XidEntry(
            74,
            "NVLink Error",
            "critical",
            Action.REBOOT,
            "an NVLink connection failed; a GPU reset (reboot) retrains the links",
            breaks_workload=True,
        ),
        XidEntry(
            79,
            "GPU has fallen off the bus",
            "critical",
            Action.POWER_CYCLE,
            "the GPU no longer answers on the PCIe bus; only a loss of power brings it back, so "
            "the host is power cycled",
            breaks_workload=True,
        ),
        XidEntry(
            92,
            "High single-bit ECC error rate",
            "warning",
            Action.NONE,
            "correctable errors are frequent; they are corrected, watch for double-bit errors",
        ),
        XidEntry(
            94,
            "Contained ECC error",
            "warning",
            Action.NONE,
            "an uncorrectable memory error was contained to the application that hit it; "
            "restart the job, the GPU keeps working",
            transient=True,
        ),
        XidEntry(
            95,
            "Uncontained ECC error",
            "critical",
            Action.REBOOT,
            "an uncorrectable memory error could not be contained; every application on the GPU "
            "is affected and the GPU must be reset (reboot)",
            breaks_workload=True,
        ),
        XidEntry(
            119,
            "GSP RPC timeout",
            "critical",
            Action.REBOOT,
            "the GPU System Processor stopped answering the driver; a GPU reset (reboot) "
            "recovers it",
            breaks_workload=True,
        ),
        XidEntry(
            120,
            "GSP error",
            "critical",
            Action.REBOOT,
            "the GPU System Processor reported an error; a GPU reset (reboot) recovers it",
            breaks_workload=True,
        ),
        XidEntry(
            140,
            "Unrecovered ECC error",
            "critical",
            Action.REBOOT,
            "the driver could not recover from a memory error; the GPU must be reset (reboot)",
            breaks_workload=True,
        ),
        XidEntry(
            154,
            "GPU recovery action changed",
            "critical",
            Action.REBOOT,
            "the driver says the GPU needs a reset or the node a reboot",
            breaks_workload=True,
        ),
    ]
}


_RECOVERY_ACTION = re.compile(r"to 0x[0-9a-fA-F]{1,8} \(([^)]{0,64})\)")


def xid_entry(code: int, detail: str = "") -> XidEntry:
    """The catalog's entry; Xid 154 reads its own recovery action; unknown codes need a person."""
    if code == 154 and detail:
        wanted = _RECOVERY_ACTION.search(detail)
        if wanted is not None and wanted.group(1).strip().lower() in ("none", "drain p2p"):
            return XidEntry(
                154,
                "GPU recovery action changed",
                "warning",
                Action.NONE,
                "the driver asks for no reset",
            )
    found = XID_CATALOG.get(code)
    if found is not None:
        return found
    return XidEntry(
        code,
        f"Xid {code}",
        "warning",
        Action.NONE,
        "this Xid is not in the catalog; a person should read NVIDIA's Xid catalog and decide",
    )


@dataclass(frozen=True, slots=True)
class KindEntry:
    title: str
    severity: Severity
    action: Action
    meaning: str
    breaks_workload: bool = False  # R17, as for Xids


KINDS: dict[AlertKind, KindEntry] = {
    AlertKind.GPU_OFF_BUS: KindEntry(
        "GPU fell off the PCIe bus",
        "critical",
        Action.POWER_CYCLE,
        "the GPU or its PCIe link stopped answering; only a loss of power brings it back, so "
        "the host is power cycled",
        breaks_workload=True,
    ),
    AlertKind.ECC_DOUBLE_BIT: KindEntry(
        "Double-bit ECC errors",
        "critical",
        Action.REBOOT,
        "DCGM counts uncorrectable (double-bit) memory errors since the last GPU reset; the GPU "
        "must be reset (reboot) so the bad rows are remapped",
        breaks_workload=True,
    ),
    AlertKind.ROW_REMAP_PENDING: KindEntry(
        "Row remapping pending",
        "warning",
        Action.REBOOT,
        "DCGM reports memory rows waiting to be remapped, which happens at the next GPU reset "
        "(reboot)",
    ),
    AlertKind.ROW_REMAP_FAILURE: KindEntry(
        "Row remapping failed",
        "critical",
        Action.MIGRATE,
        "the GPU has no spare memory rows left to remap bad ones; the hardware must be replaced, "
        "so the machine moves to another host",
        breaks_workload=True,
    ),
    AlertKind.THERMAL_THROTTLING: KindEntry(
        "GPU thermal throttling",
        "warning",
        Action.MIGRATE,
        "the GPU slows its clocks because it runs too hot; the host's cooling is at fault, so "
        "the machine moves to another host",
    ),
    AlertKind.READONLY_FILESYSTEM: KindEntry(
        "Filesystem remounted read-only",
        "critical",
        Action.REBOOT,
        "the kernel remounted a filesystem read-only after I/O errors (Node Problem Detector "
        "condition ReadonlyFilesystem); a reboot checks and remounts it",
        breaks_workload=True,
    ),
    AlertKind.INFINIBAND_PORT_DOWN: KindEntry(
        "InfiniBand port down",
        "critical",
        Action.REBOOT,
        "an InfiniBand rail is not active; a reboot resets the adapter and retrains the link",
    ),
    AlertKind.INFINIBAND_FLAPPING: KindEntry(
        "InfiniBand link flapping",
        "warning",
        Action.MIGRATE,
        "an InfiniBand link keeps going down and up (its link_downed counter climbs); cables, "
        "transceivers or the adapter are at fault, so the machine moves to another host",
    ),
    AlertKind.HOST_UNREACHABLE: KindEntry(
        "Host unreachable",
        "critical",
        Action.REBOOT,
        "the host-side reachability check failed several times in a row; the machine is "
        "rebooted from the host side",
        breaks_workload=True,
    ),
    AlertKind.NODE_NOT_READY: KindEntry(
        "Node not ready",
        "info",
        Action.NONE,
        "the node's heartbeats stopped; this alone never triggers a repair, because it cannot "
        "tell a failed node from an unreachable one (a failed health check must confirm it)",
    ),
    AlertKind.EXTERNAL: KindEntry(
        "Repair requested by an external detector",
        "warning",
        Action.NONE,
        "an external detector asked for a repair with its own evidence",
    ),
}


@dataclass(frozen=True, slots=True)
class Meaning:
    summary: str
    description: str
    severity: Severity
    action: Action
    breaks_workload: bool = False


def meaning(
    kind: AlertKind, subject: str, xid: int | None = None, detail: str = "", node: str = ""
) -> Meaning:
    """The stable summary, plain description, severity and lightest action of a signal."""
    where = f" on {node}" if node else ""
    if kind is AlertKind.XID and xid is not None:
        entry = xid_entry(xid, detail)
        return Meaning(
            summary=f"Xid {xid} ({entry.name}) on GPU {subject}{where}",
            description=f"The NVIDIA driver logged Xid {xid}, {entry.name}: {entry.meaning}.",
            severity=entry.severity,
            action=entry.action,
            breaks_workload=entry.breaks_workload,
        )
    kind_entry = KINDS[kind]
    return Meaning(
        summary=f"{kind_entry.title} ({subject}){where}",
        description=kind_entry.meaning[:1].upper() + kind_entry.meaning[1:] + ".",
        severity=kind_entry.severity,
        action=kind_entry.action,
        breaks_workload=kind_entry.breaks_workload,
    )


def breaks_workload_rule(summary: str) -> str:
    """The rule as the audit trail and the job's events say it (R17)."""
    return (
        f"R17: {summary} takes away what the member's ranks run on; a running gang's epoch "
        "ends at once and the repair does not wait for idle"
    )

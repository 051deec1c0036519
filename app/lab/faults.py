"""A simulated machine's detector inputs under `STATE_DIR/machines/NAME/`, in the real formats:
a healthy baseline, faults written the way the kernel, dcgm-exporter, Node Problem Detector and
sysfs write them (`nodus fault inject`), and what a reboot, a reprovision and a migration do
to them (the local machine provider).

Volatile state (the kernel log, DCGM's volatile ECC counters, NPD conditions, InfiniBand link
state) starts over at every boot. Hardware state (row remapping failures, thermal throttling,
and any fault injected `--sticky`) survives reboots and reprovisions and stays with the host
when the machine migrates away."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from services.monitor import monitor
from services.monitor.detectors import prom
from services.monitor.detectors.dcgm import (
    DBE_VOLATILE,
    ROW_REMAP_FAILURE,
    ROW_REMAP_PENDING,
    THERMAL_VIOLATION,
)

CLOCK_REASONS = "DCGM_FI_DEV_CLOCKS_EVENT_REASONS"
GPU_TEMP = "DCGM_FI_DEV_GPU_TEMP"
DCGM_FIELDS = {
    DBE_VOLATILE: ("counter", "Total number of double-bit volatile ECC errors."),
    ROW_REMAP_FAILURE: ("gauge", "Whether remapping of rows has failed."),
    ROW_REMAP_PENDING: ("gauge", "Whether remapping of rows is pending."),
    THERMAL_VIOLATION: ("counter", "Throttling duration due to thermal constraints (in us)."),
    CLOCK_REASONS: ("gauge", "Current clock event reasons (bitmask)."),
    GPU_TEMP: ("gauge", "GPU temperature (in C)."),
}
HARDWARE_FIELDS = (ROW_REMAP_FAILURE, CLOCK_REASONS)  # survive a reboot
PCI_ADDRESSES = [
    "0000:18:00",
    "0000:2a:00",
    "0000:3a:00",
    "0000:5d:00",
    "0000:9a:00",
    "0000:ab:00",
    "0000:ba:00",
    "0000:db:00",
]
STICKY = "faults.sticky"  # JSON lines: faults that are hardware (survive reboots)
SCRATCH = "scratch"  # the machine's local disk for its ranks (NODUS_SCRATCH_DIR)
# A machine's data, not its detector inputs: never copied through a rebuild's staging.
UNSTAGED = ("logs", SCRATCH)
BLACKHOLE = monitor.BLACKHOLE  # the simulated network partition the reachability probe honours

XID_MESSAGES = {
    13: "Graphics SM Warp Exception on (GPC 0, TPC 0, SM 0): Out Of Range Address",
    31: "Ch 00000008, intr 10000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ "
    "0x7f12_34560000. Fault is of type FAULT_PDE ACCESS_TYPE_READ",
    43: "Ch 00000010",
    48: "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at "
    "partition 0, subpartition 0.",
    79: "GPU has fallen off the bus.",
    94: "Contained: SM (0x1). RST: No, D-RST: No",
    95: "Uncontained: FBHUB. RST: Yes, D-RST: No",
    119: "Timeout after 6s of waiting for RPC response from GPU0 GSP! Expected function 76 "
    "(GSP_RM_CONTROL) (0x20800a4c 0x4).",
}

KINDS = (
    "xid",
    "gpu-off-bus",
    "pcie-link-down",
    "ecc-dbe",
    "row-remap-failure",
    "row-remap-pending",
    "thermal",
    "readonly-fs",
    "ib-down",
    "ib-flap",
    "unreachable",
)


@dataclass(frozen=True, slots=True)
class Fault:
    kind: str
    gpu: int = 0
    xid: int = 79
    port: str = "mlx5_0/1"
    count: int = 1


def pci(gpu: int) -> str:
    return PCI_ADDRESSES[gpu % len(PCI_ADDRESSES)]


def _write(path: Path, text: str) -> None:
    """Whole-file writes land at once (a reader never sees half of one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as file:
        file.write(text)
    os.replace(tmp, path)


def _append(path: Path, line: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as file:
        file.write(line + "\n")


def _uptime() -> str:
    return f"[{time.monotonic() % 100000:12.6f}]"


# -- dcgm-exporter text --------------------------------------------------------------------------


def read_dcgm(path: Path) -> dict[tuple[str, int], float]:
    try:
        parsed = prom.parse(path.read_text(errors="replace"))
    except OSError:
        return {}
    values = {}
    for sample in parsed.samples:
        gpu = sample.labels.get("gpu", "")
        if sample.name in DCGM_FIELDS and gpu.isdigit():
            values[(sample.name, int(gpu))] = sample.value
    return values


def write_dcgm(path: Path, values: dict[tuple[str, int], float], node: str) -> None:
    gpus = sorted({gpu for _, gpu in values}) or list(range(8))
    lines = []
    for field, (kind, help_text) in DCGM_FIELDS.items():
        lines.append(f"# HELP {field} {help_text}")
        lines.append(f"# TYPE {field} {kind}")
        for gpu in gpus:
            bus = pci(gpu).upper().replace("0000:", "00000000:", 1) + ".0"
            labels = (
                f'gpu="{gpu}",UUID="GPU-{node}-{gpu}",pci_bus_id="{bus}",device="nvidia{gpu}",'
                f'modelName="NVIDIA H100 80GB HBM3",Hostname="{node}"'
            )
            default = 35.0 if field == GPU_TEMP else 0.0
            lines.append(f"{field}{{{labels}}} {values.get((field, gpu), default):g}")
    _write(path, "\n".join(lines) + "\n")


def _set_dcgm(directory: Path, field: str, gpu: int, value: float | None = None) -> None:
    path = directory / "dcgm.prom"
    values = read_dcgm(path)
    if value is None:
        value = values.get((field, gpu), 0.0) + 1
    values[(field, gpu)] = value
    write_dcgm(path, values, directory.name)


# -- InfiniBand sysfs ----------------------------------------------------------------------------


def _port_dir(directory: Path, port: str) -> Path:
    device, _, number = port.partition("/")
    return directory / "sys" / "class" / "infiniband" / device / "ports" / (number or "1")


def write_port(directory: Path, port: str, active: bool, link_downed: int | None = None) -> None:
    base = _port_dir(directory, port)
    (base / "counters").mkdir(parents=True, exist_ok=True)
    _write(base / "state", "4: ACTIVE\n" if active else "1: DOWN\n")
    _write(base / "phys_state", "5: LinkUp\n" if active else "3: Disabled\n")
    if link_downed is not None:
        _write(base / "counters" / "link_downed", f"{link_downed}\n")


def _link_downed(directory: Path, port: str) -> int:
    try:
        return int((_port_dir(directory, port) / "counters" / "link_downed").read_text().strip())
    except (OSError, ValueError):
        return 0


# -- baseline, injection, clearing ---------------------------------------------------------------


def _boot_log() -> str:
    return (
        "[    0.000000] Linux version 6.5.0-nodus (simulated machine boot)\n"
        "[    4.211873] nvidia: loading out-of-tree module taints kernel.\n"
        "[    4.390127] NVRM: loading NVIDIA UNIX x86_64 Kernel Module  550.90.07\n"
    )


def _npd(readonly: bool) -> str:
    condition = {
        "type": "ReadonlyFilesystem",
        "status": "True" if readonly else "False",
        "reason": "FilesystemIsReadOnly" if readonly else "FilesystemIsNotReadOnly",
        "message": "Remounting filesystem read-only" if readonly else "Filesystem is not read-only",
        "lastTransitionTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    return json.dumps({"conditions": [condition]}, indent=2) + "\n"


def ensure_baseline(directory: Path, gpus: int = 8, ib_ports: int = 4) -> None:
    """A healthy machine's files, where missing."""
    directory.mkdir(parents=True, exist_ok=True)
    if not (directory / "kmsg").exists():
        _write(directory / "kmsg", _boot_log())
    if not (directory / "dcgm.prom").exists():
        write_dcgm(
            directory / "dcgm.prom", {(GPU_TEMP, g): 35.0 for g in range(gpus)}, directory.name
        )
    if not (directory / "npd.json").exists():
        _write(directory / "npd.json", _npd(False))
    for index in range(ib_ports):
        port = f"mlx5_{index}/1"
        if not (_port_dir(directory, port) / "state").exists():
            write_port(directory, port, True, 0)


def inject(directory: Path, fault: Fault, sticky: bool = False) -> str:
    """Write one fault in its real format; returns what was written, for the operator."""
    if fault.kind not in KINDS:
        raise ValueError(f"unknown fault {fault.kind!r}; one of {', '.join(KINDS)}")
    ensure_baseline(directory)
    written = _apply(directory, fault)
    if sticky:
        _append(directory / STICKY, json.dumps(_as_dict(fault)))
    return written


def _as_dict(fault: Fault) -> dict[str, object]:
    return {
        "kind": fault.kind,
        "gpu": fault.gpu,
        "xid": fault.xid,
        "port": fault.port,
        "count": fault.count,
    }


def _apply(directory: Path, fault: Fault) -> str:
    kmsg = directory / "kmsg"
    address = pci(fault.gpu)
    if fault.kind == "xid":
        message = XID_MESSAGES.get(fault.xid, f"Xid {fault.xid} reported by the driver.")
        line = (
            f"{_uptime()} NVRM: Xid (PCI:{address}): {fault.xid}, pid=4242, name=python3, {message}"
        )
        _append(kmsg, line)
        return f"{kmsg}: {line}"
    if fault.kind == "gpu-off-bus":
        line = f"{_uptime()} NVRM: GPU {address}.0: GPU has fallen off the bus."
        _append(kmsg, line)
        return f"{kmsg}: {line}"
    if fault.kind == "pcie-link-down":
        line = f"{_uptime()} pcieport {address}.0: pciehp: Slot({fault.gpu + 1}): Link Down"
        _append(kmsg, line)
        return f"{kmsg}: {line}"
    if fault.kind == "ecc-dbe":
        _set_dcgm(directory, DBE_VOLATILE, fault.gpu, None if fault.count == 1 else fault.count)
        return f"{directory / 'dcgm.prom'}: {DBE_VOLATILE} gpu {fault.gpu} +{fault.count}"
    if fault.kind in ("row-remap-failure", "row-remap-pending"):
        field = ROW_REMAP_FAILURE if fault.kind == "row-remap-failure" else ROW_REMAP_PENDING
        _set_dcgm(directory, field, fault.gpu, 1.0)
        return f"{directory / 'dcgm.prom'}: {field} gpu {fault.gpu} = 1"
    if fault.kind == "thermal":
        _set_dcgm(directory, CLOCK_REASONS, fault.gpu, 0x40)
        _set_dcgm(directory, GPU_TEMP, fault.gpu, 92.0)
        return f"{directory / 'dcgm.prom'}: {CLOCK_REASONS} gpu {fault.gpu} = 0x40 (HW thermal slowdown)"
    if fault.kind == "readonly-fs":
        _write(directory / "npd.json", _npd(True))
        return f"{directory / 'npd.json'}: ReadonlyFilesystem True (FilesystemIsReadOnly)"
    if fault.kind == "ib-down":
        write_port(directory, fault.port, False)
        return f"{_port_dir(directory, fault.port)}: state 1: DOWN, phys_state 3: Disabled"
    if fault.kind == "ib-flap":
        count = _link_downed(directory, fault.port) + max(fault.count, 1)
        write_port(directory, fault.port, True, count)
        return f"{_port_dir(directory, fault.port)}/counters/link_downed = {count}"
    (directory / BLACKHOLE).write_text("the host monitor's reachability probe gets no answer\n")
    return f"{directory / BLACKHOLE}: host unreachable"


def clear(directory: Path, kind: str | None = None) -> None:
    """Undo injected faults (all, or one kind), sticky ones included."""
    if kind is None:
        if directory.exists():
            shutil.rmtree(directory)
        ensure_baseline(directory)
        return
    sticky = [f for f in sticky_faults(directory) if f.kind != kind]
    _write(directory / STICKY, "".join(json.dumps(_as_dict(f)) + "\n" for f in sticky))
    if kind in ("xid", "gpu-off-bus", "pcie-link-down"):
        _write(directory / "kmsg", _boot_log())
    elif kind in ("ecc-dbe", "row-remap-failure", "row-remap-pending", "thermal"):
        (directory / "dcgm.prom").unlink(missing_ok=True)
    elif kind == "readonly-fs":
        _write(directory / "npd.json", _npd(False))
    elif kind in ("ib-down", "ib-flap"):
        shutil.rmtree(directory / "sys", ignore_errors=True)
    else:
        (directory / BLACKHOLE).unlink(missing_ok=True)
    ensure_baseline(directory)


def sticky_faults(directory: Path) -> list[Fault]:
    faults = []
    try:
        lines = (directory / STICKY).read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        try:
            data = json.loads(line)
            faults.append(
                Fault(
                    kind=str(data["kind"]),
                    gpu=int(data.get("gpu", 0)),
                    xid=int(data.get("xid", 79)),
                    port=str(data.get("port", "mlx5_0/1")),
                    count=int(data.get("count", 1)),
                )
            )
        except (ValueError, KeyError, TypeError):
            continue
    return faults


# -- what repairs do to the files ------------------------------------------------------------------


def _rebuild(directory: Path, transform: Callable[[Path], None]) -> None:
    """Change a machine's files in a staging copy, then swap each file in at once: a detector
    reading meanwhile sees every file either before or after, never half-way."""
    staging = directory.parent / f".{directory.name}.staging"
    if staging.exists():
        shutil.rmtree(staging)
    if directory.exists():
        shutil.copytree(directory, staging, ignore=_unstaged_at(directory))
    else:
        staging.mkdir(parents=True)
    transform(staging)
    kept = set()
    for path in sorted(staging.rglob("*")):
        if path.is_file():
            relative = path.relative_to(staging)
            kept.add(relative)
            target = directory / relative
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, target)
    for path in sorted(directory.rglob("*"), reverse=True):
        relative = path.relative_to(directory)
        if path.is_file() and relative not in kept and relative.parts[0] not in UNSTAGED:
            path.unlink()
    shutil.rmtree(staging)


def _unstaged_at(top: Path) -> Callable[[str, list[str]], list[str]]:
    def ignore(where: str, entries: list[str]) -> list[str]:
        return [e for e in entries if e in UNSTAGED] if Path(where) == top else []

    return ignore


def reboot(directory: Path) -> None:
    """A new boot: volatile state starts over; hardware faults come back."""
    _rebuild(directory, _reboot)


def _reboot(directory: Path) -> None:
    ensure_baseline(directory)
    _write(directory / "kmsg", _boot_log())
    values = read_dcgm(directory / "dcgm.prom")
    kept = {key: value for key, value in values.items() if key[0] in (*HARDWARE_FIELDS, GPU_TEMP)}
    for gpu in {gpu for _, gpu in values}:
        kept.setdefault((GPU_TEMP, gpu), 35.0)
    write_dcgm(directory / "dcgm.prom", kept, directory.name)
    _write(directory / "npd.json", _npd(False))
    root = directory / "sys" / "class" / "infiniband"
    for device in sorted(root.glob("*")) if root.exists() else []:
        for port in sorted((device / "ports").glob("*")):
            write_port(directory, f"{device.name}/{port.name}", True, 0)
    (directory / BLACKHOLE).unlink(missing_ok=True)
    for fault in sticky_faults(directory):
        _apply(directory, fault)


def reprovision(directory: Path) -> None:
    """A clean image on the same host: local data (`scratch/`) is gone; the hardware is what
    it was; the machine's identity and logs stay."""
    _rebuild(directory, _reprovision)
    shutil.rmtree(directory / SCRATCH, ignore_errors=True)


# What a machine keeps through a clean image and onto a new host: the identity its provider
# hands it at boot (its bus user's seed) and the rank logs the platform keeps for the user.
# Everything else, `scratch/` (NODUS_SCRATCH_DIR) included, is the image's or the host's.
MACHINE_IDENTITY = ("nats.nk", "logs")


def _keep_identity(directory: Path, transform: Callable[[Path], None]) -> None:
    """Run `transform` on the machine's files with its identity set aside and put back."""
    aside = directory.parent / f".{directory.name}.identity"
    if aside.exists():
        shutil.rmtree(aside)
    aside.mkdir(parents=True)
    for name in MACHINE_IDENTITY:
        if (directory / name).exists():
            shutil.move(str(directory / name), str(aside / name))
    try:
        transform(directory)
    finally:
        for name in MACHINE_IDENTITY:
            if (aside / name).exists():
                directory.mkdir(parents=True, exist_ok=True)
                if (directory / name).is_dir():
                    shutil.rmtree(directory / name)
                shutil.move(str(aside / name), str(directory / name))
        shutil.rmtree(aside, ignore_errors=True)


def _reprovision(directory: Path) -> None:
    _keep_identity(directory, _clean_image)


def _clean_image(directory: Path) -> None:
    values = read_dcgm(directory / "dcgm.prom")
    hardware = {key: value for key, value in values.items() if key[0] in HARDWARE_FIELDS}
    sticky = sticky_faults(directory)
    shutil.rmtree(directory)
    ensure_baseline(directory)
    if hardware:
        base = read_dcgm(directory / "dcgm.prom")
        write_dcgm(directory / "dcgm.prom", {**base, **hardware}, directory.name)
    if sticky:
        _write(directory / STICKY, "".join(json.dumps(_as_dict(f)) + "\n" for f in sticky))
        for fault in sticky:
            _apply(directory, fault)


def move_to_host(directory: Path, host_directory: Path) -> None:
    """The machine leaves its host: the host keeps its files (its hardware state, for the
    diagnostics of revalidation); the machine starts fresh elsewhere."""

    def leave(machine: Path) -> None:
        if host_directory.exists():
            shutil.rmtree(host_directory)
        host_directory.parent.mkdir(parents=True, exist_ok=True)
        if machine.exists():
            shutil.move(str(machine), str(host_directory))
        else:
            ensure_baseline(host_directory)
        ensure_baseline(machine)

    _keep_identity(directory, leave)  # the machine's identity and logs go with it

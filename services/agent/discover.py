"""The agent describes its own machine (O1): GPUs through NVML (nvidia-ml-py), else
`nvidia-smi -q -x`, else `amd-smi static --json`, else `rocm-smi --json`; interfaces from the
kernel (`ip -j`); NUMA nodes from sysfs; whether it can create a WireGuard device and use UDP,
by trying. The parsing and the assembly are sans-I/O (libs/discovery)."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import shutil
import socket
import struct
import subprocess
from pathlib import Path
from typing import Any

import msgspec
import yaml

from libs.contracts.base import convert
from libs.contracts.fleet import Inventory, MachineFacts
from libs.discovery.gpus import (
    DiscoveryError,
    Gpu,
    GpuReport,
    model_warning,
    normal_bus_id,
    parse_amd_smi_static,
    parse_nvidia_smi_xml,
    parse_rocm_smi,
)
from libs.discovery.machine import Tried, inventory_from, parse_default_route, parse_ip_addr
from services.agent.inventory import network_namespace

log = logging.getLogger("nodus.agent.discover")

MACHINE_FILE = Path("/etc/nodus/machine.yaml")
TOOL_TIMEOUT = 30.0
TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000


def _run(argv: list[str], warnings: list[str]) -> str | None:
    """The tool's output; None when it is not installed (said nowhere: most machines lack
    most tools) or when it failed (said in `warnings`: a GPU tool that is there but fails is
    what an operator must see)."""
    if shutil.which(argv[0]) is None:
        return None
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=TOOL_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as error:
        warnings.append(f"{argv[0]} did not run: {error}")
        return None
    if done.returncode != 0:
        said = (done.stderr.strip() or done.stdout.strip())[-300:]
        warnings.append(f"{' '.join(argv)} exited {done.returncode}: {said}")
        return None
    return done.stdout


def _decoded(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def read_nvml(nvml: Any) -> GpuReport | None:
    """The GPUs NVML sees, through nvidia-ml-py's bindings (`nvml`: the pynvml module) and the
    driver's libnvidia-ml.so.1. None: NVML is not there (no driver, no library), or cannot
    start (said in the report's warnings of the next tool, and logged here)."""
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as error:
        # LIBRARY_NOT_FOUND and DRIVER_NOT_LOADED: not an NVIDIA machine. Anything else (no
        # permission, driver/library mismatch) is an NVIDIA machine NVML cannot read.
        quiet = (nvml.NVML_ERROR_LIBRARY_NOT_FOUND, nvml.NVML_ERROR_DRIVER_NOT_LOADED)
        log.log(logging.DEBUG if error.value in quiet else logging.WARNING, "NVML: %s", error)
        return None
    warnings: list[str] = []
    try:
        gpus = []
        for index in range(nvml.nvmlDeviceGetCount()):
            gpu = _nvml_gpu(nvml, index, warnings)
            if gpu is not None:
                gpus.append(gpu)
        driver = _decoded(nvml.nvmlSystemGetDriverVersion())
        cuda = int(nvml.nvmlSystemGetCudaDriverVersion())
    except nvml.NVMLError as error:
        raise DiscoveryError(f"NVML: {error}") from None
    finally:
        with contextlib.suppress(nvml.NVMLError):
            nvml.nvmlShutdown()
    # Positions, not NVML's indices: a lost GPU left out is not one CUDA numbers either.
    gpus = [Gpu(i, g.product, g.pci_bus_id, g.memory_mib, g.numa_node) for i, g in enumerate(gpus)]
    return GpuReport(
        backend="cuda",
        gpus=gpus,
        driver_version=driver,
        runtime_version=f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda > 0 else "",
        warnings=warnings,
    )


def _nvml_gpu(nvml: Any, index: int, warnings: list[str]) -> Gpu | None:
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
    except nvml.NVMLError as error:
        if error.value != nvml.NVML_ERROR_GPU_IS_LOST:
            raise
        # Off the bus (R1): the machine is described without it, and says so.
        warnings.append(f"NVML GPU {index}: {error}: left out of the inventory")
        return None
    product = _decoded(nvml.nvmlDeviceGetName(handle))
    bus_id = normal_bus_id(_decoded(nvml.nvmlDeviceGetPciInfo(handle).busId))
    where = f"GPU {bus_id}"
    if (note := model_warning(product, where)) is not None:
        warnings.append(note)
    try:
        memory = int(nvml.nvmlDeviceGetMemoryInfo(handle).total) >> 20
    except nvml.NVMLError as error:
        warnings.append(f"{where}: memory size not reported (NVML: {error})")
        memory = 0
    numa: int | None = None
    # NVML 12.4 (driver 550) on; an older library has no such function, and sysfs says it.
    with contextlib.suppress(nvml.NVMLError):
        node = int(nvml.nvmlDeviceGetNumaNodeId(handle))
        numa = node if node >= 0 else None
    return Gpu(index=index, product=product, pci_bus_id=bus_id, memory_mib=memory, numa_node=numa)


def _nvml() -> GpuReport | None:
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    return read_nvml(pynvml)


def _rocm_version() -> str:
    try:
        return Path("/opt/rocm/.info/version").read_text().strip()
    except OSError:
        return ""


def gpu_report() -> tuple[GpuReport | None, list[str]]:
    """The first tool that answers, and what the tools before it said when they failed;
    None: no GPU tool answered (0 accelerators, the warnings say why when one was there)."""
    warnings: list[str] = []
    report = _nvml()
    if report is None and (text := _run(["nvidia-smi", "-q", "-x"], warnings)) is not None:
        report = parse_nvidia_smi_xml(text)
    if report is None and (text := _run(["amd-smi", "static", "--json"], warnings)) is not None:
        report = parse_amd_smi_static(text, _rocm_version())
    argv = ["rocm-smi", "--showproductname", "--showbus", "--showmeminfo", "vram", "--json"]
    if report is None and (text := _run(argv, warnings)) is not None:
        report = parse_rocm_smi(text, _rocm_version())
    return report, warnings


def numa_nodes(report: GpuReport | None) -> dict[str, int]:
    found = {}
    for gpu in report.gpus if report is not None else []:
        with contextlib.suppress(OSError, ValueError):
            found[gpu.pci_bus_id] = int(
                Path(f"/sys/bus/pci/devices/{gpu.pci_bus_id}/numa_node").read_text()
            )
    return found


def try_wireguard_device() -> bool:
    """Can this machine create a tun device (what wireguard-go's nodus0 is)? Tried with a
    throwaway name; the device goes when the file is closed."""
    try:
        fd = os.open("/dev/net/tun", os.O_RDWR)
    except OSError:
        return False
    try:
        name = f"nodustry{secrets.token_hex(3)}".encode()[:15]
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name, IFF_TUN | IFF_NO_PI))
        return True
    except OSError:  # no CAP_NET_ADMIN
        return False
    finally:
        os.close(fd)


def try_udp() -> bool:
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.bind(("0.0.0.0", 0))
        return True
    except OSError:
        return False


def load_facts(path: Path, overrides: dict[str, Any]) -> MachineFacts:
    """/etc/nodus/machine.yaml (when there), with the flags given winning."""
    document: dict[str, Any] = {}
    if path.exists():
        loaded = yaml.safe_load(path.read_text()) or {}
        if not isinstance(loaded, dict):
            raise DiscoveryError(f"{path}: not a mapping of machine facts")
        document.update(loaded)
    document.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return convert(document, MachineFacts)
    except msgspec.ValidationError as error:  # "missing required field `provider`"
        raise DiscoveryError(f"{error} (a flag, or a key of {path})") from None


def discover(node: str, facts: MachineFacts) -> tuple[Inventory, list[str]]:
    report, warnings = gpu_report()
    ip_warnings: list[str] = []
    interfaces = parse_ip_addr(_run(["ip", "-j", "addr", "show"], ip_warnings) or "[]")
    default = parse_default_route(
        _run(["ip", "-j", "route", "show", "default"], ip_warnings) or "[]"
    )
    for warning in ip_warnings:
        log.warning("%s", warning)
    tried = Tried(wireguard_device=try_wireguard_device(), udp=try_udp())
    inventory, capabilities = inventory_from(
        node,
        facts,
        interfaces,
        default,
        report,
        tried,
        numa_nodes(report),
        network_namespace(),
        warnings,
    )
    acc = inventory.accelerators
    for warning in acc.warnings:  # also in the inventory (accelerators.warnings)
        log.warning("discovery: %s", warning)
    log.info(
        "%s: %s, %dx %s (%s), address %s on %s",
        node,
        inventory.offering,
        acc.count,
        acc.model,
        acc.backend,
        inventory.address,
        facts.interface or default,
    )
    return inventory, capabilities

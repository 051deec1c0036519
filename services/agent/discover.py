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
from libs.contracts.fleet import Inventory
from libs.discovery.gpus import (
    DiscoveryError,
    Gpu,
    GpuReport,
    normal_bus_id,
    parse_amd_smi_static,
    parse_nvidia_smi_xml,
    parse_rocm_smi,
)
from libs.discovery.machine import (
    MachineFacts,
    Tried,
    inventory_from,
    parse_default_route,
    parse_ip_addr,
)
from services.agent.inventory import network_namespace

log = logging.getLogger("nodus.agent.discover")

MACHINE_FILE = Path("/etc/nodus/machine.yaml")
TOOL_TIMEOUT = 30.0
TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000


def _run(argv: list[str]) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=TOOL_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as error:
        log.warning("%s did not run: %s", argv[0], error)
        return None
    if done.returncode != 0:
        log.warning("%s exited %d: %s", " ".join(argv), done.returncode, done.stderr.strip()[-300:])
        return None
    return done.stdout


def _nvml() -> GpuReport | None:
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:  # no driver, no libnvidia-ml: not an NVIDIA machine
        return None
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            bus = pynvml.nvmlDeviceGetPciInfo(handle).busId
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle).total
            gpus.append(
                Gpu(
                    index=index,
                    product=name.decode() if isinstance(name, bytes) else str(name),
                    pci_bus_id=normal_bus_id(bus.decode() if isinstance(bus, bytes) else bus),
                    memory_mib=int(memory) >> 20,
                )
            )
        driver = pynvml.nvmlSystemGetDriverVersion()
        cuda = pynvml.nvmlSystemGetCudaDriverVersion()
        return GpuReport(
            backend="cuda",
            gpus=gpus,
            driver_version=driver.decode() if isinstance(driver, bytes) else str(driver),
            runtime_version=f"{cuda // 1000}.{cuda % 1000 // 10}",
        )
    finally:
        pynvml.nvmlShutdown()


def _rocm_version() -> str:
    try:
        return Path("/opt/rocm/.info/version").read_text().strip()
    except OSError:
        return ""


def gpu_report() -> GpuReport | None:
    """The first tool that answers; None: no GPU tool on this machine (0 accelerators)."""
    report = _nvml()
    if report is not None:
        return report
    if (text := _run(["nvidia-smi", "-q", "-x"])) is not None:
        return parse_nvidia_smi_xml(text)
    if (text := _run(["amd-smi", "static", "--json"])) is not None:
        return parse_amd_smi_static(text, _rocm_version())
    argv = ["rocm-smi", "--showproductname", "--showbus", "--showmeminfo", "vram", "--json"]
    if (text := _run(argv)) is not None:
        return parse_rocm_smi(text, _rocm_version())
    return None


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
    report = gpu_report()
    interfaces = parse_ip_addr(_run(["ip", "-j", "addr", "show"]) or "[]")
    default = parse_default_route(_run(["ip", "-j", "route", "show", "default"]) or "[]")
    tried = Tried(wireguard_device=try_wireguard_device(), udp=try_udp())
    inventory, capabilities = inventory_from(
        node, facts, interfaces, default, report, tried, numa_nodes(report), network_namespace()
    )
    acc = inventory.accelerators
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

"""What a machine's GPU tools say, parsed without I/O (O1): `nvidia-smi -q -x` (XML),
`amd-smi static --json` and `rocm-smi --showproductname --showbus --showmeminfo vram --json`.
NVML itself (nvidia-ml-py) is read by the agent's shell into the same `Gpu` records.

Each parser takes the tool's whole output and returns a `GpuReport`; output that is not what
the tool writes raises `DiscoveryError` saying what was missing, never a half inventory.
"""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass, field
from typing import Any

from libs.contracts.jobs import Backend


class DiscoveryError(Exception):
    """A tool's output that cannot be read as that tool's output."""


@dataclass(frozen=True)
class Gpu:
    index: int
    product: str  # as the tool says it: "NVIDIA H100 80GB HBM3"
    pci_bus_id: str  # domain:bus:device.function, lower case, 4-digit domain: 0000:18:00.0
    memory_mib: int = 0
    numa_node: int | None = None  # None: the tool does not say (sysfs does)


@dataclass(frozen=True)
class GpuReport:
    backend: Backend
    gpus: list[Gpu] = field(default_factory=list)
    driver_version: str = ""
    runtime_version: str = ""  # CUDA or ROCm


# Brand words before the model in product names: "NVIDIA H100 80GB HBM3" is an H100.
_BRANDS = {"nvidia", "tesla", "geforce", "quadro", "amd", "instinct", "radeon"}


def model_of(product: str) -> str:
    """The model the placer matches jobs on: the first word after the brand, without its
    form factor ("NVIDIA A100-SXM4-80GB" -> A100, "AMD Instinct MI300X" -> MI300X)."""
    words = [w for w in re.split(r"\s+", product.strip()) if w.lower() not in _BRANDS]
    if not words:
        return product.strip() or "unknown"
    first = re.split(r"[-/]", words[0])[0]
    if first.upper() == "RTX" and len(words) > 1:  # "GeForce RTX 4090" -> RTX4090
        first += re.split(r"[-/]", words[1])[0]
    return first


def normal_bus_id(bus_id: str) -> str:
    """nvidia-smi writes 00000000:18:00.0, sysfs and AMD 0000:18:00.0: one form, lower case."""
    text = bus_id.strip().lower()
    match = re.fullmatch(r"(?:([0-9a-f]{4,8}):)?([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])", text)
    if match is None:
        raise DiscoveryError(f"{bus_id!r} is not a PCI bus id")
    domain, bus, device, function = match.groups()
    return f"{int(domain or '0', 16):04x}:{bus}:{device}.{function}"


def _mib(text: str) -> int:
    """'81559 MiB', '196592 MB', 205822885888 (bytes) -> MiB."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]i?B|B)?\s*", str(text), re.IGNORECASE)
    if match is None:
        return 0
    value = float(match.group(1))
    unit = (match.group(2) or "B").upper().replace("I", "")
    factor = {"B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40}[unit]
    return int(value * factor) >> 20


# -- NVIDIA --------------------------------------------------------------------------------


def parse_nvidia_smi_xml(text: str) -> GpuReport:
    try:
        root = ElementTree.fromstring(text)
    except ElementTree.ParseError as error:
        raise DiscoveryError(f"nvidia-smi -q -x: not XML: {error}") from None
    if root.tag != "nvidia_smi_log":
        raise DiscoveryError(f"nvidia-smi -q -x: root element {root.tag!r}, not nvidia_smi_log")
    gpus = []
    for position, element in enumerate(root.findall("gpu")):
        product = element.findtext("product_name")
        bus_id = element.findtext("pci/pci_bus_id") or element.get("id")
        if not product or not bus_id:
            raise DiscoveryError(f"nvidia-smi -q -x: GPU {position} has no product_name or bus id")
        minor = element.findtext("minor_number") or ""
        gpus.append(
            Gpu(
                index=int(minor) if minor.isdigit() else position,
                product=product.strip(),
                pci_bus_id=normal_bus_id(bus_id),
                memory_mib=_mib(element.findtext("fb_memory_usage/total") or ""),
            )
        )
    # nvidia-smi lists GPUs by bus id; CUDA's default order (FASTEST_FIRST aside) is the same.
    gpus.sort(key=lambda g: g.pci_bus_id)
    gpus = [Gpu(i, g.product, g.pci_bus_id, g.memory_mib, g.numa_node) for i, g in enumerate(gpus)]
    return GpuReport(
        backend="cuda",
        gpus=gpus,
        driver_version=(root.findtext("driver_version") or "").strip(),
        runtime_version=(root.findtext("cuda_version") or "").strip(),
    )


# -- AMD -----------------------------------------------------------------------------------


def _load_json(text: str, tool: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as error:
        raise DiscoveryError(f"{tool}: not JSON: {error}") from None


def _value(entry: Any) -> Any:
    """amd-smi writes {"value": 196592, "unit": "MB"} in newer versions, "196592 MB" before."""
    if isinstance(entry, dict) and "value" in entry:
        return f"{entry['value']} {entry.get('unit', '')}".strip()
    return entry


def parse_amd_smi_static(text: str, rocm_version: str = "") -> GpuReport:
    data = _load_json(text, "amd-smi static --json")
    if isinstance(data, dict) and "gpu_data" in data:  # ROCm 6.3+ wraps the list
        data = data["gpu_data"]
    if not isinstance(data, list):
        raise DiscoveryError("amd-smi static --json: not a list of GPUs")
    gpus, driver = [], ""
    for position, entry in enumerate(data):
        if not isinstance(entry, dict):
            raise DiscoveryError(f"amd-smi static --json: GPU {position} is not an object")
        asic, bus = entry.get("asic") or {}, entry.get("bus") or {}
        product, bdf = asic.get("market_name"), bus.get("bdf")
        if not product or not bdf:
            raise DiscoveryError(f"amd-smi static --json: GPU {position} has no market_name or bdf")
        vram = (entry.get("vram") or {}).get("size", "")
        numa = (entry.get("numa") or {}).get("node")
        driver = driver or str((entry.get("driver") or {}).get("version", ""))
        gpus.append(
            Gpu(
                index=int(entry.get("gpu", position)),
                product=str(product).strip(),
                pci_bus_id=normal_bus_id(str(bdf)),
                memory_mib=_mib(_value(vram)),
                numa_node=int(numa) if isinstance(numa, int) and numa >= 0 else None,
            )
        )
    gpus.sort(key=lambda g: g.index)
    return GpuReport(backend="rocm", gpus=gpus, driver_version=driver, runtime_version=rocm_version)


def parse_rocm_smi(text: str, rocm_version: str = "") -> GpuReport:
    """`rocm-smi --showproductname --showbus --showmeminfo vram --json`: {"card0": {...}}."""
    data = _load_json(text, "rocm-smi --json")
    if not isinstance(data, dict):
        raise DiscoveryError("rocm-smi --json: not an object of cards")
    gpus, driver = [], ""
    for key, card in data.items():
        if key == "system":
            driver = str(card.get("Driver version", "")) if isinstance(card, dict) else ""
            continue
        match = re.fullmatch(r"card(\d+)", key)
        if match is None or not isinstance(card, dict):
            continue
        product = card.get("Card Series") or card.get("Card series") or card.get("Card model")
        bdf = card.get("PCI Bus")
        if not product or not bdf:
            raise DiscoveryError(f"rocm-smi --json: {key} has no card series or PCI bus")
        gpus.append(
            Gpu(
                index=int(match.group(1)),
                product=str(product).strip(),
                pci_bus_id=normal_bus_id(str(bdf)),
                memory_mib=_mib(str(card.get("VRAM Total Memory (B)", ""))),
            )
        )
    gpus.sort(key=lambda g: g.index)
    return GpuReport(backend="rocm", gpus=gpus, driver_version=driver, runtime_version=rocm_version)

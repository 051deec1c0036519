"""What a machine's GPU tools say, parsed without I/O (O1): `nvidia-smi -q -x` (XML),
`amd-smi static --json` and `rocm-smi --showproductname --showbus --showmeminfo vram --json`.
NVML itself (nvidia-ml-py) is read by the agent's shell into the same `Gpu` records.

Each parser takes the tool's whole output and returns a `GpuReport`. What it cannot do without
(a GPU's product name or bus id, the document itself) raises `DiscoveryError` saying what was
missing, never a half inventory. What it can do without but does not understand (a unit it does
not know, a value the tool did not report, an architecture or a DTD version it was not written
for, an attribute it has not seen) is never guessed at: the value stays unknown (0 MiB) and the
report's `warnings` say why, for the agent's log and the inventory.
"""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ElementTree
from collections.abc import Mapping
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
    memory_mib: int = 0  # 0: not known (a warning says why)
    numa_node: int | None = None  # None: the tool does not say (sysfs does)


@dataclass(frozen=True)
class GpuReport:
    backend: Backend
    gpus: list[Gpu] = field(default_factory=list)
    driver_version: str = ""
    runtime_version: str = ""  # CUDA or ROCm
    warnings: list[str] = field(default_factory=list)  # what was not understood, said plainly


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


def model_warning(product: str, where: str) -> str | None:
    """Every accelerator model has a number in it (H100, L4, MI300X, RTX4090). A product name
    without one ("NVIDIA Graphics Device": a driver older than the GPU) names no model, and the
    placer would match jobs on a word that is not one."""
    model = model_of(product)
    if re.search(r"\d", model):
        return None
    return f"{where}: product {product!r} names no model the placer knows (read as {model!r})"


def normal_bus_id(bus_id: str) -> str:
    """nvidia-smi writes 00000000:18:00.0, sysfs and AMD 0000:18:00.0: one form, lower case."""
    text = bus_id.strip().lower()
    match = re.fullmatch(r"(?:([0-9a-f]{4,8}):)?([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])", text)
    if match is None:
        raise DiscoveryError(f"{bus_id!r} is not a PCI bus id")
    domain, bus, device, function = match.groups()
    return f"{int(domain or '0', 16):04x}:{bus}:{device}.{function}"


# What the tools write where a value is not available: nvidia-smi's "N/A", "[N/A]" (not
# available in this mode), "[Not Supported]", "Unknown Error", "Insufficient Permissions",
# "Requested functionality has been deprecated"; amd-smi's and rocm-smi's "N/A".
_NOT_REPORTED = re.compile(
    r"\[?(n/a|not supported|not available|unknown error|insufficient permissions|"
    r"requested functionality has been deprecated|gpu is lost|none|unknown)?\]?",
    re.IGNORECASE,
)
_MAX_MIB = 1 << 30  # 1 PiB: a memory size beyond it is a misread, not a GPU

# Units each tool writes, in bytes. nvidia-smi writes MiB; amd-smi's "MB" are MiB (its library
# counts VRAM in units of 2^20: an MI300X's 192 GiB is "196592 MB"); rocm-smi writes bytes.
NVIDIA_SMI_UNITS: Mapping[str, int] = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
AMD_SMI_UNITS: Mapping[str, int] = {"MB": 1 << 20}
BYTES: Mapping[str, int] = {"": 1}


def is_not_reported(value: object) -> bool:
    return value is None or (
        isinstance(value, str) and _NOT_REPORTED.fullmatch(value.strip()) is not None
    )


def memory_mib(raw: object, units: Mapping[str, int], where: str, warnings: list[str]) -> int:
    """A memory size in MiB, or 0 with a warning: never a guess at a unit or a number."""
    if is_not_reported(raw):
        warnings.append(f"{where}: memory size not reported ({raw!r})")
        return 0
    text = "?" if isinstance(raw, bool) else str(raw).strip()
    match = re.fullmatch(r"([0-9]{1,20}(?:\.[0-9]{1,6})?)\s*([A-Za-z]*)", text)
    if match is None:
        warnings.append(f"{where}: memory size {text[:40]!r} is not a number")
        return 0
    number, unit = match.groups()
    if unit not in units:
        known = ", ".join(repr(u) for u in units)
        warnings.append(f"{where}: memory unit {unit!r} unknown (this tool writes {known})")
        return 0
    mib = int(float(number) * units[unit]) >> 20
    if mib > _MAX_MIB:
        warnings.append(f"{where}: memory size {text[:40]!r} is not plausible")
        return 0
    return mib


def _check_unique(gpus: list[Gpu], tool: str) -> None:
    seen: set[str] = set()
    for gpu in gpus:
        if gpu.pci_bus_id in seen:
            raise DiscoveryError(f"{tool}: two GPUs on one bus id {gpu.pci_bus_id}")
        seen.add(gpu.pci_bus_id)


def _text(value: object) -> str:
    return value.strip() if isinstance(value, str) else ""


# -- NVIDIA --------------------------------------------------------------------------------

# The device DTD versions this parser was checked against (nvsmi_device_vNN.dtd, named by the
# output's DOCTYPE): v11 (470-era drivers), v12 (525 to 550), v13 (570 on). What it reads
# (product, bus id, memory, versions) is the same in all three.
NVSMI_DTD_VERSIONS = frozenset({11, 12, 13})
# product_architecture values nvidia-smi writes (NVML's nvmlDeviceArchitecture_t names).
NVIDIA_ARCHITECTURES = frozenset(
    {
        "Kepler",
        "Maxwell",
        "Pascal",
        "Volta",
        "Turing",
        "Ampere",
        "Ada Lovelace",
        "Hopper",
        "Blackwell",
    }
)
_DOCTYPE = re.compile(r'<!DOCTYPE\s+nvidia_smi_log\s+SYSTEM\s+"nvsmi_device_v(\d+)\.dtd"\s*>')
_GPU_ATTRIBUTES = frozenset({"id"})


def parse_nvidia_smi_xml(text: str) -> GpuReport:
    try:
        root = ElementTree.fromstring(text)
    except (ElementTree.ParseError, ValueError) as error:
        raise DiscoveryError(f"nvidia-smi -q -x: not XML: {error}") from None
    if root.tag != "nvidia_smi_log":
        raise DiscoveryError(f"nvidia-smi -q -x: root element {root.tag!r}, not nvidia_smi_log")
    warnings: list[str] = []
    doctype = _DOCTYPE.search(text[:4096])
    if doctype is None:
        warnings.append("nvidia-smi -q -x: no nvsmi_device DOCTYPE: the format is not known")
    elif int(doctype.group(1)) not in NVSMI_DTD_VERSIONS:
        known = ", ".join(f"v{v}" for v in sorted(NVSMI_DTD_VERSIONS))
        warnings.append(
            f"nvidia-smi -q -x: written to nvsmi_device_v{doctype.group(1)}.dtd; "
            f"this parser was checked against {known}"
        )
    if root.attrib:
        warnings.append(f"nvidia-smi -q -x: unknown attributes on nvidia_smi_log: {root.attrib}")
    if (error_string := _text(root.findtext("error_string"))) != "":
        warnings.append(f"nvidia-smi -q -x: error_string {error_string!r}")
    elements = root.findall("gpu")
    attached = _text(root.findtext("attached_gpus"))
    if not attached.isdigit():
        warnings.append(f"nvidia-smi -q -x: attached_gpus {attached!r} is not a count")
    elif int(attached) != len(elements):
        warnings.append(
            f"nvidia-smi -q -x: attached_gpus says {attached} but {len(elements)} gpu elements"
        )
    gpus = [_nvidia_gpu(position, element, warnings) for position, element in enumerate(elements)]
    _check_unique(gpus, "nvidia-smi -q -x")
    # nvidia-smi lists GPUs by bus id; CUDA's default order (FASTEST_FIRST aside) is the same.
    gpus.sort(key=lambda g: g.pci_bus_id)
    gpus = [Gpu(i, g.product, g.pci_bus_id, g.memory_mib, g.numa_node) for i, g in enumerate(gpus)]
    driver = _text(root.findtext("driver_version"))
    cuda = _text(root.findtext("cuda_version"))
    for name, value in (("driver_version", driver), ("cuda_version", cuda)):
        if is_not_reported(value) or not re.fullmatch(r"[0-9][0-9.]*", value):
            warnings.append(f"nvidia-smi -q -x: {name} {value!r} not reported or not a version")
    return GpuReport(
        backend="cuda",
        gpus=gpus,
        driver_version=driver if re.fullmatch(r"[0-9][0-9.]*", driver) else "",
        runtime_version=cuda if re.fullmatch(r"[0-9][0-9.]*", cuda) else "",
        warnings=warnings,
    )


def _nvidia_gpu(position: int, element: ElementTree.Element, warnings: list[str]) -> Gpu:
    product = _text(element.findtext("product_name"))
    bus_text = _text(element.findtext("pci/pci_bus_id")) or _text(element.get("id"))
    if not product or is_not_reported(product) or not bus_text:
        raise DiscoveryError(
            f"nvidia-smi -q -x: GPU {position} has no product_name or bus id "
            f"(product {product!r}, bus id {bus_text!r})"
        )
    bus_id = normal_bus_id(bus_text)
    where = f"GPU {bus_id}"
    if unknown := set(element.attrib) - _GPU_ATTRIBUTES:
        warnings.append(f"{where}: unknown attributes {sorted(unknown)}")
    attribute = element.get("id")
    if attribute is not None and _normal_or_none(attribute) != bus_id:
        warnings.append(f"{where}: gpu id {attribute!r} is not its pci_bus_id")
    architecture = element.findtext("product_architecture")
    if architecture is not None and not is_not_reported(architecture):
        if architecture.strip() not in NVIDIA_ARCHITECTURES:
            warnings.append(f"{where}: product_architecture {architecture.strip()!r} unknown")
    if (note := model_warning(product, where)) is not None:
        warnings.append(note)
    if _text(element.findtext("mig_mode/current_mig")) == "Enabled":
        warnings.append(f"{where}: MIG is enabled; Nodus offers whole GPUs, not MIG instances")
    total = element.find("fb_memory_usage/total")
    if total is None:
        warnings.append(f"{where}: no fb_memory_usage/total: memory size not known")
        memory = 0
    else:
        memory = memory_mib(total.text, NVIDIA_SMI_UNITS, where, warnings)
    return Gpu(index=position, product=product, pci_bus_id=bus_id, memory_mib=memory)


def _normal_or_none(text: str) -> str | None:
    try:
        return normal_bus_id(text)
    except DiscoveryError:
        return None


# -- AMD -----------------------------------------------------------------------------------


def _load_json(text: str, tool: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as error:
        raise DiscoveryError(f"{tool}: not JSON: {str(error)[:200]}") from None


def _object(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _amd_smi_memory(vram: object, where: str, warnings: list[str]) -> int:
    """amd-smi writes {"value": 196592, "unit": "MB"} in JSON (ROCm 6.1 on), "196592 MB" in
    text; a bare number has no unit to read it by."""
    if isinstance(vram, dict) and "value" in vram:
        value, unit = vram.get("value"), vram.get("unit", "")
        if is_not_reported(value):
            return memory_mib(value, AMD_SMI_UNITS, where, warnings)
        if not isinstance(value, int | float | str) or not isinstance(unit, str):
            warnings.append(f"{where}: vram size {vram!r} is not a value and a unit")
            return 0
        return memory_mib(f"{value} {unit}".strip(), AMD_SMI_UNITS, where, warnings)
    return memory_mib(vram, AMD_SMI_UNITS, where, warnings)


def _index(value: object, fallback: int, tool: str) -> int:
    if value is None:
        return fallback
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 4096:
        return value
    if isinstance(value, str) and value.isdigit() and int(value) < 4096:
        return int(value)
    raise DiscoveryError(f"{tool}: GPU index {value!r} is not a number")


def parse_amd_smi_static(text: str, rocm_version: str = "") -> GpuReport:
    tool = "amd-smi static --json"
    data = _load_json(text, tool)
    if isinstance(data, dict) and "gpu_data" in data:  # ROCm 6.3+ wraps the list
        data = data["gpu_data"]
    if not isinstance(data, list):
        raise DiscoveryError(f"{tool}: not a list of GPUs")
    gpus, driver, warnings = [], "", []
    for position, entry in enumerate(data):
        if not isinstance(entry, dict):
            raise DiscoveryError(f"{tool}: GPU {position} is not an object")
        asic, bus = _object(entry.get("asic")), _object(entry.get("bus"))
        product, bdf = asic.get("market_name"), bus.get("bdf")
        if not isinstance(product, str) or not isinstance(bdf, str) or is_not_reported(product):
            raise DiscoveryError(
                f"{tool}: GPU {position} has no market_name or bdf "
                f"(market_name {product!r}, bdf {bdf!r})"
            )
        bus_id = normal_bus_id(bdf)
        where = f"GPU {bus_id}"
        if (note := model_warning(product, where)) is not None:
            warnings.append(note)
        memory = _amd_smi_memory(_object(entry.get("vram")).get("size"), where, warnings)
        numa = _object(entry.get("numa")).get("node")
        # -1: the GPU has no NUMA node (amd-smi's own meaning); sysfs is asked instead.
        if not (numa is None or numa == -1 or is_not_reported(numa) or _is_count(numa)):
            warnings.append(f"{where}: numa node {numa!r} is not a node number")
        version = _object(entry.get("driver")).get("version")
        if not driver and isinstance(version, str) and not is_not_reported(version):
            driver = version.strip()
        gpus.append(
            Gpu(
                index=_index(entry.get("gpu"), position, tool),
                product=product.strip(),
                pci_bus_id=bus_id,
                memory_mib=memory,
                numa_node=numa if _is_count(numa) else None,
            )
        )
    if gpus and not driver:
        warnings.append(f"{tool}: driver version not reported")
    return _amd_report(gpus, driver, rocm_version, warnings, tool)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 4096


def _amd_report(
    gpus: list[Gpu], driver: str, rocm_version: str, warnings: list[str], tool: str
) -> GpuReport:
    _check_unique(gpus, tool)
    if len({g.index for g in gpus}) != len(gpus):
        raise DiscoveryError(f"{tool}: two GPUs with one index")
    gpus.sort(key=lambda g: g.index)
    return GpuReport(
        backend="rocm",
        gpus=gpus,
        driver_version=driver,
        runtime_version=rocm_version,
        warnings=warnings,
    )


_ROCM_SMI_SERIES = ("Card Series", "Card series")  # the key's case changed across versions


def parse_rocm_smi(text: str, rocm_version: str = "") -> GpuReport:
    """`rocm-smi --showproductname --showbus --showmeminfo vram --json`: {"card0": {...}}."""
    tool = "rocm-smi --json"
    data = _load_json(text, tool)
    if not isinstance(data, dict):
        raise DiscoveryError(f"{tool}: not an object of cards")
    gpus, driver, warnings = [], "", []
    for key, card in data.items():
        if key == "system":
            version = _object(card).get("Driver version")
            driver = version.strip() if isinstance(version, str) else ""
            continue
        match = re.fullmatch(r"card(\d{1,4})", key)
        if match is None or not isinstance(card, dict):
            warnings.append(f"{tool}: {key!r} is neither a card nor the system: not read")
            continue
        # "Card Model" is the PCI device id (0x74a1), not a product: not a stand-in.
        product = next((card[k] for k in _ROCM_SMI_SERIES if k in card), None)
        bdf = card.get("PCI Bus")
        if not isinstance(product, str) or not isinstance(bdf, str) or is_not_reported(product):
            raise DiscoveryError(
                f"{tool}: {key} has no card series or PCI bus "
                f"(card series {product!r}, PCI bus {bdf!r})"
            )
        bus_id = normal_bus_id(bdf)
        where = f"GPU {bus_id}"
        if (note := model_warning(product, where)) is not None:
            warnings.append(note)
        gpus.append(
            Gpu(
                index=int(match.group(1)),
                product=product.strip(),
                pci_bus_id=bus_id,
                memory_mib=memory_mib(card.get("VRAM Total Memory (B)"), BYTES, where, warnings),
            )
        )
    if gpus and not driver:
        warnings.append(f"{tool}: driver version not reported")
    return _amd_report(gpus, driver, rocm_version, warnings, tool)

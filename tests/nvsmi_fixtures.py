"""`nvidia-smi -q -x` documents for the discovery tests, built from the element structure real
drivers write (tests/fixtures/discovery/nvsmi-structure.json: names, nesting and order per
device DTD version, no values) and values written here for 8-GPU H100 and B200 machines.
Every element a driver of that DTD version writes is there, in its place; what the tests do
not read is "N/A", as nvidia-smi writes it for what a GPU does not report.

`python -m tests.nvsmi_fixtures` writes the fixtures; `check_structure` is what the tests
hold each fixture to.
"""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "discovery"
STRUCTURE: dict[str, Any] = json.loads((FIXTURES / "nvsmi-structure.json").read_text())


@dataclass(frozen=True)
class Card:
    product: str
    brand: str
    architecture: str
    bus: str  # 18: the bus number, on domain 0
    memory_mib: int
    reserved_mib: int
    bar1_mib: int
    device_id: str  # PCI device and vendor: 233010DE
    serial: str
    module: int
    board_part: str
    vbios: str


def _leaves(card: Card, minor: int) -> dict[str, str]:
    """Values by path below <gpu>; every other leaf is N/A."""
    bus = f"00000000:{card.bus.upper()}:00.0"
    return {
        "product_name": card.product,
        "product_brand": card.brand,
        "product_architecture": card.architecture,
        "display_mode": "Disabled",
        "display_attached": "No",
        "display_active": "Disabled",
        "persistence_mode": "Enabled",
        "addressing_mode": "None",
        "mig_mode/current_mig": "Disabled",
        "mig_mode/pending_mig": "Disabled",
        "accounting_mode": "Disabled",
        "accounting_mode_buffer_size": "4000",
        "serial": card.serial,
        "uuid": f"GPU-6d1e0c2a-4b7f-4c1e-9a3d-{card.serial[-12:].rjust(12, '0')}",
        "minor_number": str(minor),
        "vbios_version": card.vbios,
        "multigpu_board": "No",
        "board_id": f"0x{card.bus}00",
        "board_part_number": card.board_part,
        "gpu_module_id": str(card.module),
        "platformInfo/module_id": str(card.module),
        "pci/pci_bus": card.bus.upper(),
        "pci/pci_device": "00",
        "pci/pci_domain": "0000",
        "pci/pci_base_class": "3",
        "pci/pci_sub_class": "2",
        "pci/pci_device_id": card.device_id,
        "pci/pci_bus_id": bus,
        "pci/pci_sub_system_id": f"{card.device_id[:4]}10DE",
        "pci/pci_gpu_link_info/pcie_gen/max_link_gen": "5",
        "pci/pci_gpu_link_info/pcie_gen/current_link_gen": "5",
        "pci/pci_gpu_link_info/pcie_gen/device_current_link_gen": "5",
        "pci/pci_gpu_link_info/pcie_gen/max_device_link_gen": "5",
        "pci/pci_gpu_link_info/pcie_gen/max_host_link_gen": "5",
        "pci/pci_gpu_link_info/link_widths/max_link_width": "16x",
        "pci/pci_gpu_link_info/link_widths/current_link_width": "16x",
        "pci/replay_counter": "0",
        "pci/replay_rollover_counter": "0",
        "pci/tx_util": "0 KB/s",
        "pci/rx_util": "0 KB/s",
        "performance_state": "P0",
        "fb_memory_usage/total": f"{card.memory_mib} MiB",
        "fb_memory_usage/reserved": f"{card.reserved_mib} MiB",
        "fb_memory_usage/used": "1 MiB",
        "fb_memory_usage/free": f"{card.memory_mib - card.reserved_mib - 1} MiB",
        "bar1_memory_usage/total": f"{card.bar1_mib} MiB",
        "bar1_memory_usage/used": "1 MiB",
        "bar1_memory_usage/free": f"{card.bar1_mib - 1} MiB",
        "cc_protected_memory_usage/total": "0 MiB",
        "cc_protected_memory_usage/used": "0 MiB",
        "cc_protected_memory_usage/free": "0 MiB",
        "compute_mode": "Default",
        "utilization/gpu_util": "0 %",
        "utilization/memory_util": "0 %",
        "ecc_mode/current_ecc": "Enabled",
        "ecc_mode/pending_ecc": "Enabled",
        "temperature/gpu_temp": f"{29 + minor % 5} C",
        "temperature/memory_temp": f"{34 + minor % 4} C",
        "gpu_power_readings/power_state": "P0",
        "gpu_power_readings/current_power_limit": "700.00 W",
        "gpu_power_readings/default_power_limit": "700.00 W",
        "gpu_power_readings/min_power_limit": "200.00 W",
        "gpu_power_readings/max_power_limit": "700.00 W",
        "clocks/graphics_clock": "345 MHz",
        "clocks/sm_clock": "345 MHz",
        "clocks/mem_clock": "2619 MHz",
        "clocks/video_clock": "765 MHz",
        "max_clocks/graphics_clock": "1980 MHz",
        "max_clocks/sm_clock": "1980 MHz",
        "max_clocks/mem_clock": "2619 MHz",
        "max_clocks/video_clock": "1545 MHz",
        "supported_clocks/supported_mem_clock/value": "2619 MHz",
        "supported_clocks/supported_mem_clock/supported_graphics_clock": "1980 MHz",
    }


# Children a driver writes instead of others in one DTD version (an older GPU's names for the
# same temperature thresholds; the processes of a busy GPU): not written by these machines.
_NOT_WRITTEN = {
    "gpu/temperature/gpu_temp_max_threshold",
    "gpu/temperature/gpu_temp_slow_threshold",
    "gpu/temperature/gpu_temp_max_gpu_threshold",
    "gpu/temperature/gpu_temp_max_mem_threshold",
    "gpu/processes/process_info",
}


def _fill(
    parent: ElementTree.Element, path: str, table: dict[str, list[str]], values: dict[str, str]
) -> None:
    for tag in table[path]:
        here = f"{path}/{tag}"
        leaf = here.removeprefix("gpu/")
        if here in _NOT_WRITTEN:
            continue
        element = ElementTree.SubElement(parent, tag)
        if tag == "mig_devices" and values.get("mig_mode/current_mig") != "Enabled":
            element.text = "None"  # as nvidia-smi writes it without MIG
        elif here in table and any(f"{here}/{c}" not in _NOT_WRITTEN for c in table[here]):
            _fill(element, here, table, values)
        elif tag in ("processes", "accounted_processes"):
            element.text = ""  # none running: an empty element, as nvidia-smi writes it
        else:
            element.text = values.get(leaf, "N/A")


def render(version: int, driver: str, cuda: str, cards: list[Card], when: str) -> str:
    """One document as nvidia-smi writes it: its declaration, DOCTYPE and tab indentation."""
    root = ElementTree.Element("nvidia_smi_log")
    for tag, text in (
        ("timestamp", when),
        ("driver_version", driver),
        ("cuda_version", cuda),
        ("attached_gpus", str(len(cards))),
    ):
        ElementTree.SubElement(root, tag).text = text
    for minor, card in enumerate(cards):
        gpu = ElementTree.SubElement(root, "gpu", id=f"00000000:{card.bus.upper()}:00.0")
        _fill(gpu, "gpu", STRUCTURE["gpu"][f"v{version}"], _leaves(card, minor))
    ElementTree.indent(root, space="\t")
    body = ElementTree.tostring(root, encoding="unicode", short_empty_elements=False)
    return (
        '<?xml version="1.0" ?>\n'
        f'<!DOCTYPE nvidia_smi_log SYSTEM "nvsmi_device_v{version}.dtd">\n{body}\n'
    )


def _children_in_order(
    element: ElementTree.Element, path: str, table: dict[str, list[str]]
) -> list[str]:
    """What is wrong with the children of one element (and below), against the table."""
    names = [child.tag for child in element]
    if not names:
        return []  # text: N/A, None, or a value
    allowed = table.get(path)
    if allowed is None:
        return [f"{path}: has children {names[:5]}, where drivers write text"]
    problems = [
        f"{path}/{name}: not an element drivers write" for name in names if name not in allowed
    ]
    positions = [allowed.index(name) for name in names if name in allowed]
    if positions != sorted(positions):
        problems.append(f"{path}: children out of the drivers' order: {names}")
    for child in element:
        problems += _children_in_order(child, f"{path}/{child.tag}", table)
    return problems


def check_structure(text: str) -> list[str]:
    """What in a `nvidia-smi -q -x` document differs from what drivers of its DTD version write:
    the root's content model, each <gpu>'s elements (names, nesting, order), the gpu `id`
    attribute, the framebuffer sizes in MiB. Empty: it is shaped as a driver would write it."""
    doctype = re.search(r'<!DOCTYPE nvidia_smi_log SYSTEM "nvsmi_device_v(\d+)\.dtd">', text)
    if doctype is None or f"v{doctype.group(1)}" not in STRUCTURE["gpu"]:
        return [f"no DOCTYPE of a device DTD version known here: {text[:120]!r}"]
    root = ElementTree.fromstring(text)
    problems: list[str] = []
    order = " ".join(child.tag for child in root)
    model = (
        r"timestamp driver_version cuda_version( vgpu_driver_capability)* attached_gpus"
        r"( error_string)?( gpu)*"
    )
    if not re.fullmatch(model, order):
        problems.append(f"nvidia_smi_log children {order!r} do not follow the DTD's order")
    table = STRUCTURE["gpu"][f"v{doctype.group(1)}"]
    for gpu in root.findall("gpu"):
        where = gpu.get("id")
        if set(gpu.attrib) != {"id"}:
            problems.append(f"gpu {where}: attributes {sorted(gpu.attrib)}, not id")
        problems += [f"gpu {where}: {p}" for p in _children_in_order(gpu, "gpu", table)]
        for size in gpu.findall("fb_memory_usage/*"):
            if not re.fullmatch(r"\d+ MiB", size.text or ""):
                problems.append(f"gpu {where}: fb_memory_usage/{size.tag} {size.text!r}")
    return problems


H100 = {
    "product": "NVIDIA H100 80GB HBM3",
    "brand": "NVIDIA",
    "architecture": "Hopper",
    "memory_mib": 81559,
    "reserved_mib": 551,
    "bar1_mib": 131072,
    "device_id": "233010DE",
    "board_part": "692-2G520-0200-000",
    "vbios": "96.00.99.00.01",
}
B200 = {
    "product": "NVIDIA B200",
    "brand": "NVIDIA",
    "architecture": "Blackwell",
    "memory_mib": 183359,
    "reserved_mib": 1142,
    "bar1_mib": 262144,
    "device_id": "290110DE",
    "board_part": "692-2G525-0230-000",
    "vbios": "97.00.6B.00.02",
}
BUSES = ["18", "2a", "3a", "5d", "9a", "ab", "ba", "db"]


def eight(model: dict[str, Any], serial: int) -> list[Card]:
    return [
        Card(bus=bus, serial=str(serial + i), module=i + 1, **model) for i, bus in enumerate(BUSES)
    ]


DOCUMENTS: dict[str, Callable[[], str]] = {
    "nvidia-smi-q-x-8xH100.xml": lambda: render(
        12, "535.183.01", "12.2", eight(H100, 1652323020000), "Tue Dec  1 09:12:44 2026"
    ),
    "nvidia-smi-q-x-8xB200-v13.xml": lambda: render(
        13, "595.84", "13.2", eight(B200, 1795123450000), "Wed Dec  2 10:41:07 2026"
    ),
}


if __name__ == "__main__":
    for name, build in DOCUMENTS.items():
        (FIXTURES / name).write_text(build())
        print(FIXTURES / name)

"""Each GPU tool parser refuses what it cannot do without and reports, never guesses, what it
does not understand (O1): unknown units, values the tool did not report, unknown DTD versions,
architectures, attributes and keys, products that name no model. The report reaches the
inventory (accelerators.warnings)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from libs.contracts.fleet import MachineFacts
from libs.discovery.gpus import (
    NVIDIA_SMI_UNITS,
    DiscoveryError,
    memory_mib,
    parse_amd_smi_static,
    parse_nvidia_smi_xml,
    parse_rocm_smi,
)
from libs.discovery.machine import Tried, accelerators_of, inventory_from, parse_ip_addr

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "discovery"
H100 = (FIXTURES / "nvidia-smi-q-x-8xH100.xml").read_text()
AMD = json.loads((FIXTURES / "amd-smi-static-json-8xMI300X.json").read_text())
ROCM = json.loads((FIXTURES / "rocm-smi-json-8xMI300X.json").read_text())


def _first_total(value: str) -> str:
    return H100.replace("<total>81559 MiB</total>", f"<total>{value}</total>", 1)


@pytest.mark.parametrize(
    ("total", "said"),
    [
        ("N/A", "memory size not reported ('N/A')"),
        ("[N/A]", "memory size not reported ('[N/A]')"),
        ("[Not Supported]", "memory size not reported ('[Not Supported]')"),
        ("81559 MB", "memory unit 'MB' unknown (this tool writes 'KiB', 'MiB', 'GiB')"),
        ("81559", "memory unit '' unknown"),
        ("lots MiB", "memory size 'lots MiB' is not a number"),
        ("99999999999999 GiB", "is not plausible"),
    ],
)
def test_nvidia_memory_that_is_not_understood_is_unknown_and_said(total: str, said: str) -> None:
    report = parse_nvidia_smi_xml(_first_total(total))
    assert report.gpus[0].memory_mib == 0 and {g.memory_mib for g in report.gpus[1:]} == {81559}
    assert len(report.warnings) == 1 and said in report.warnings[0]
    assert report.warnings[0].startswith("GPU 0000:18:00.0: ")


def test_nvidia_memory_in_other_binary_units_is_read() -> None:
    assert parse_nvidia_smi_xml(_first_total("80 GiB")).gpus[0].memory_mib == 81920
    assert memory_mib("1048576 KiB", NVIDIA_SMI_UNITS, "x", []) == 1024


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (("nvsmi_device_v12.dtd", "nvsmi_device_v14.dtd"), "written to nvsmi_device_v14.dtd"),
        (('<!DOCTYPE nvidia_smi_log SYSTEM "nvsmi_device_v12.dtd">', ""), "no nvsmi_device"),
        (("<product_architecture>Hopper", "<product_architecture>Rubin"), "'Rubin' unknown"),
        (('<gpu id="00000000:18:00.0">', '<gpu id="00000000:18:00.0" vf="1">'), "['vf']"),
        (('<gpu id="00000000:18:00.0">', '<gpu id="00000000:19:00.0">'), "is not its pci_bus_id"),
        (("<attached_gpus>8", "<attached_gpus>9"), "attached_gpus says 9 but 8"),
        (("<attached_gpus>8", "<attached_gpus>N/A"), "attached_gpus 'N/A' is not a count"),
        (
            (
                "<attached_gpus>8</attached_gpus>",
                "<attached_gpus>8</attached_gpus>"
                "<error_string>GPU 0000:3a:00.0 is lost</error_string>",
            ),
            "error_string 'GPU 0000:3a:00.0 is lost'",
        ),
        (("<current_mig>Disabled", "<current_mig>Enabled"), "MIG is enabled"),
        (("NVIDIA H100 80GB HBM3", "NVIDIA Graphics Device"), "names no model"),
        (("<cuda_version>12.2", "<cuda_version>N/A"), "cuda_version 'N/A'"),
    ],
)
def test_nvidia_output_not_understood_is_reported(change: tuple[str, str], said: str) -> None:
    text = H100.replace(*change, 1)
    assert text != H100
    report = parse_nvidia_smi_xml(text)
    assert len(report.gpus) == 8
    assert any(said in warning for warning in report.warnings), report.warnings


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (("NVIDIA H100 80GB HBM3", "N/A"), "has no product_name or bus id"),
        (("<product_name>NVIDIA H100 80GB HBM3</product_name>", ""), "has no product_name"),
        (
            ("<pci_bus_id>00000000:2A:00.0", "<pci_bus_id>00000000:18:00.0"),
            "two GPUs on one bus id 0000:18:00.0",
        ),
        (("<pci_bus_id>00000000:18:00.0", "<pci_bus_id>N/A"), "'N/A' is not a PCI bus id"),
    ],
)
def test_nvidia_output_it_cannot_do_without_is_refused(change: tuple[str, str], said: str) -> None:
    with pytest.raises(DiscoveryError, match=said.replace("(", r"\(").replace(")", r"\)")):
        parse_nvidia_smi_xml(H100.replace(*change, 1))


def _amd(**first: Any) -> str:
    data = json.loads(json.dumps(AMD))
    for key, value in first.items():
        section, _, field = key.partition("__")
        if field:
            data[0][section][field] = value
        else:
            data[0][section] = value
    return json.dumps(data)


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"vram__size": "N/A"}, "memory size not reported ('N/A')"),
        ({"vram__size": {"value": 192, "unit": "GB"}}, "memory unit 'GB' unknown"),
        ({"vram__size": 196592}, "memory unit '' unknown"),
        ({"vram__size": {"value": [1], "unit": "MB"}}, "is not a value and a unit"),
        ({"numa__node": "zero"}, "numa node 'zero' is not a node number"),
        ({"asic__market_name": "AMD Instinct"}, "names no model"),
    ],
)
def test_amd_smi_output_not_understood_is_reported(change: dict[str, Any], said: str) -> None:
    report = parse_amd_smi_static(_amd(**change))
    assert len(report.gpus) == 8
    assert any(said in warning for warning in report.warnings), report.warnings


def test_amd_smi_values_not_reported_are_not_guesses() -> None:
    report = parse_amd_smi_static(_amd(numa__node=-1, driver={"name": "amdgpu", "version": "N/A"}))
    assert report.gpus[0].numa_node is None and report.driver_version == "6.7.0"  # from GPU 1
    assert report.warnings == []


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"asic__market_name": "N/A"}, "GPU 0 has no market_name or bdf"),
        ({"bus__bdf": "N/A"}, "'N/A' is not a PCI bus id"),
        ({"gpu": "zero"}, "GPU index 'zero' is not a number"),
        ({"gpu": 1}, "two GPUs with one index"),
    ],
)
def test_amd_smi_output_it_cannot_do_without_is_refused(change: dict[str, Any], said: str) -> None:
    with pytest.raises(DiscoveryError, match=said):
        parse_amd_smi_static(_amd(**change))


def test_rocm_smi_reads_only_its_own_keys() -> None:
    data = json.loads(json.dumps(ROCM))
    data["card0"]["VRAM Total Memory (B)"] = "N/A"
    data["gpu0"] = {"Card Series": "AMD Instinct MI300X"}
    report = parse_rocm_smi(json.dumps(data))
    assert report.gpus[0].memory_mib == 0 and len(report.gpus) == 8
    assert any("memory size not reported" in w for w in report.warnings)
    assert any("'gpu0' is neither a card nor the system" in w for w in report.warnings)
    # "Card Model" is a PCI device id, not a product to match jobs on.
    del data["card1"]["Card Series"]
    with pytest.raises(DiscoveryError, match="card1 has no card series"):
        parse_rocm_smi(json.dumps(data))


def test_the_report_reaches_the_inventory() -> None:
    report = parse_nvidia_smi_xml(_first_total("N/A"))
    acc = accelerators_of(report, {}, ["NVML: Driver/library version mismatch"])
    assert acc.warnings == [
        "NVML: Driver/library version mismatch",
        "GPU 0000:18:00.0: memory size not reported ('N/A')",
    ]
    ip_addr = json.dumps(
        [
            {
                "ifname": "eth0",
                "flags": ["UP"],
                "addr_info": [{"family": "inet", "local": "198.18.0.9", "scope": "global"}],
            }
        ]
    )
    inventory, _ = inventory_from(
        "h100-a",
        MachineFacts(provider="p", region="r"),
        parse_ip_addr(ip_addr),
        "eth0",
        None,
        Tried(wireguard_device=True, udp=True),
        {},
        "ns",
        ["nvidia-smi -q -x exited 15: GPU is lost"],
    )
    assert inventory.accelerators.count == 0
    assert inventory.accelerators.warnings == ["nvidia-smi -q -x exited 15: GPU is lost"]

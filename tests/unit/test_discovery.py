"""O1: a machine described from its own tools' output (libs/discovery), no fleet file: 8-GPU
NVIDIA and AMD machines parse to the inventory the placer needs (C5 device names, bus ids,
NUMA nodes, memory, driver and runtime versions), and a machine without GPUs or without a
WireGuard device says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from libs.contracts.base import now
from libs.contracts.fleet import MachineFacts, NodeRecord
from libs.contracts.jobs import PathClass
from libs.discovery.gpus import (
    DiscoveryError,
    model_of,
    normal_bus_id,
    parse_amd_smi_static,
    parse_nvidia_smi_xml,
    parse_rocm_smi,
)
from libs.discovery.machine import Tried, inventory_from, parse_default_route, parse_ip_addr
from services.placer.planner import Planner
from tests.factories import job
from tests.planner_support import config, must_place

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "discovery"
IP_ADDR = json.dumps(
    [
        {
            "ifname": "lo",
            "flags": ["LOOPBACK", "UP"],
            "addr_info": [
                {"family": "inet", "local": "127.0.0.1", "prefixlen": 8, "scope": "host"}
            ],
        },
        {
            "ifname": "eth0",
            "flags": ["BROADCAST", "UP", "LOWER_UP"],
            "addr_info": [
                {"family": "inet6", "local": "fe80::1", "prefixlen": 64, "scope": "link"},
                {"family": "inet", "local": "198.18.9.4", "prefixlen": 24, "scope": "global"},
            ],
        },
        {
            "ifname": "ens5",
            "flags": ["BROADCAST", "UP"],
            "addr_info": [
                {"family": "inet", "local": "198.18.109.4", "prefixlen": 24, "scope": "global"}
            ],
        },
    ]
)
ROUTE = json.dumps([{"dst": "default", "gateway": "198.18.9.254", "dev": "eth0", "flags": []}])
VM = Tried(wireguard_device=True, udp=True)


def test_nvidia_smi_xml_of_eight_h100() -> None:
    report = parse_nvidia_smi_xml((FIXTURES / "nvidia-smi-q-x-8xH100.xml").read_text())
    assert report.backend == "cuda" and len(report.gpus) == 8
    assert (report.driver_version, report.runtime_version) == ("535.183.01", "12.2")
    assert report.warnings == []
    assert [g.index for g in report.gpus] == list(range(8))
    assert report.gpus[0].pci_bus_id == "0000:18:00.0"
    assert report.gpus[7].pci_bus_id == "0000:db:00.0"
    assert {g.memory_mib for g in report.gpus} == {81559}
    assert {model_of(g.product) for g in report.gpus} == {"H100"}


def test_nvidia_smi_xml_of_eight_b200_dtd_v13() -> None:
    report = parse_nvidia_smi_xml((FIXTURES / "nvidia-smi-q-x-8xB200-v13.xml").read_text())
    assert (report.driver_version, report.runtime_version) == ("595.84", "13.2")
    assert [g.pci_bus_id for g in report.gpus][::7] == ["0000:18:00.0", "0000:db:00.0"]
    assert {(model_of(g.product), g.memory_mib) for g in report.gpus} == {("B200", 183359)}
    assert report.warnings == []


def test_amd_smi_and_rocm_smi_of_eight_mi300x() -> None:
    amd = parse_amd_smi_static(
        (FIXTURES / "amd-smi-static-json-8xMI300X.json").read_text(), "6.2.1"
    )
    rocm = parse_rocm_smi((FIXTURES / "rocm-smi-json-8xMI300X.json").read_text(), "6.2.1")
    for report in (amd, rocm):
        assert report.backend == "rocm" and len(report.gpus) == 8
        assert report.gpus[0].pci_bus_id == "0000:0c:00.0"
        assert {model_of(g.product) for g in report.gpus} == {"MI300X"}
        assert report.driver_version == "6.7.0" and report.runtime_version == "6.2.1"
    assert [g.numa_node for g in amd.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert {g.memory_mib for g in amd.gpus} == {196592}  # amd-smi's MB are MiB: 192 GiB
    assert {g.memory_mib for g in rocm.gpus} == {206141652992 >> 20}


def test_an_eight_gpu_machine_becomes_the_inventory_the_placer_needs() -> None:
    report = parse_amd_smi_static((FIXTURES / "amd-smi-static-json-8xMI300X.json").read_text())
    facts = MachineFacts(
        provider="aws",
        region="eu-west-1",
        region_class="eu",
        pool="mi300",
        cluster="eu-prod",
        private_network="vpc",
        private_interface="ens5",
    )
    inventory, capabilities = inventory_from(
        "mi300-a", facts, parse_ip_addr(IP_ADDR), parse_default_route(ROUTE), report, VM, {}, "ns"
    )
    acc = inventory.accelerators
    assert (acc.count, acc.backend, acc.model, acc.collectives) == (8, "rocm", "MI300X", "rccl")
    assert acc.visible_devices_var == "HIP_VISIBLE_DEVICES"
    assert [d.name for d in acc.devices] == [f"ROCm{i}" for i in range(8)]
    assert [d.numa_node for d in acc.devices] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert (inventory.address, inventory.private_address) == ("198.18.9.4", "198.18.109.4")
    assert inventory.offering == "vm" and "wireguard-device" in capabilities
    # Placed exactly like a machine of the fleet file.
    record = NodeRecord(
        inventory=inventory, agent_version="t", capabilities=capabilities, registered_time=now()
    )
    wanted = job(accelerators={"count": 8, "model": "MI300X"}, distributed={"members": 2})
    assert Planner(config()).eligible(wanted, record)


def test_discovered_machines_are_placed_like_fleet_ones() -> None:
    """Two machines that described themselves, on one private network: a Private gang."""
    report = parse_nvidia_smi_xml((FIXTURES / "nvidia-smi-q-x-8xH100.xml").read_text())
    facts = MachineFacts(
        provider="aws",
        region="us-east-1",
        region_class="us",
        private_network="vpc",
        private_interface="ens5",
    )
    records = []
    for index in (1, 2):
        ip = IP_ADDR.replace("198.18.9.4", f"198.18.9.{index}").replace(
            "198.18.109.4", f"198.18.109.{index}"
        )
        inventory, capabilities = inventory_from(
            f"h100-{index}", facts, parse_ip_addr(ip), "eth0", report, VM, {}, "ns"
        )
        records.append(
            NodeRecord(
                inventory=inventory,
                agent_version="t",
                capabilities=capabilities,
                registered_time=now(),
            )
        )
    wanted = job(
        accelerators={"count": 8, "model": "H100"}, distributed={"members": 2, "transport": "Auto"}
    )
    plan = must_place(wanted, records)
    assert plan.path is PathClass.PRIVATE
    assert sorted(m.address for m in plan.members) == ["198.18.109.1", "198.18.109.2"]
    assert {m.interface for m in plan.members} == {"ens5"}


def test_nvidia_numa_nodes_come_from_sysfs_and_names_from_the_backend() -> None:
    report = parse_nvidia_smi_xml((FIXTURES / "nvidia-smi-q-x-8xH100.xml").read_text())
    numa = {g.pci_bus_id: (0 if i < 4 else 1) for i, g in enumerate(report.gpus)}
    inventory, _ = inventory_from(
        "h100-a",
        MachineFacts(provider="p", region="r"),
        parse_ip_addr(IP_ADDR),
        parse_default_route(ROUTE),
        report,
        VM,
        numa,
        "ns",
    )
    acc = inventory.accelerators
    assert [d.name for d in acc.devices] == [f"CUDA{i}" for i in range(8)]
    assert [d.numa_node for d in acc.devices] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert acc.runtime_version == "12.2" and inventory.region_class == "r"


def test_no_gpus_and_no_wireguard_device_is_a_container_with_nothing_to_offer() -> None:
    inventory, capabilities = inventory_from(
        "box",
        MachineFacts(provider="p", region="r"),
        parse_ip_addr(IP_ADDR),
        parse_default_route(ROUTE),
        None,
        Tried(wireguard_device=False, udp=True),
        {},
        "ns",
    )
    assert inventory.accelerators.count == 0 and inventory.accelerators.model == "none"
    assert inventory.offering == "container" and "wireguard-device" not in capabilities


def test_bad_input_gets_a_clear_error() -> None:
    with pytest.raises(DiscoveryError, match="not XML"):
        parse_nvidia_smi_xml("No devices were found")
    with pytest.raises(DiscoveryError, match="not JSON"):
        parse_amd_smi_static("ERROR: no GPU")
    with pytest.raises(DiscoveryError, match="not a PCI bus id"):
        normal_bus_id("gpu0")
    with pytest.raises(DiscoveryError, match="give --interface"):
        inventory_from(
            "x",
            MachineFacts(provider="p", region="r"),
            parse_ip_addr(IP_ADDR),
            None,
            None,
            VM,
            {},
            "ns",
        )
    with pytest.raises(DiscoveryError, match="ens6 has no address"):
        inventory_from(
            "x",
            MachineFacts(provider="p", region="r", private_network="v", private_interface="ens6"),
            parse_ip_addr(IP_ADDR),
            "eth0",
            None,
            VM,
            {},
            "ns",
        )


@pytest.mark.parametrize(
    ("product", "model"),
    [
        ("NVIDIA H100 80GB HBM3", "H100"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("Tesla V100-SXM2-32GB", "V100"),
        ("NVIDIA L4", "L4"),
        ("NVIDIA GeForce RTX 4090", "RTX4090"),
        ("AMD Instinct MI300X", "MI300X"),
        ("AMD Instinct MI250X/MI250", "MI250X"),
    ],
)
def test_models_are_what_jobs_ask_for(product: str, model: str) -> None:
    assert model_of(product) == model

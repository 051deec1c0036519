"""A real machine's inventory (O1, T1), assembled without I/O from what the agent found:
the kernel's interfaces (`ip -j addr`, `ip -j route show default`), the GPU report, what the
machine could do when tried (create a WireGuard device, send UDP) and what the platform must
be told (flags, or /etc/nodus/machine.yaml).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from libs.contracts.epochs import CAPABILITY_JOIN_KEY_MEMBERS
from libs.contracts.fleet import AcceleratorDevice, Accelerators, Inventory, MachineFacts
from libs.contracts.jobs import Backend
from libs.contracts.relay import CAPABILITY_EPOCH_RELAYS
from libs.discovery.gpus import DiscoveryError, GpuReport, model_of

# What every agent implements; the placer refuses plans needing more (C6).
BASE_CAPABILITIES = [
    "register",
    "heartbeat",
    "join-epoch",
    CAPABILITY_JOIN_KEY_MEMBERS,
    CAPABILITY_EPOCH_RELAYS,
]
NO_ACCELERATORS = "none"  # the model of a machine without GPUs (count 0)


@dataclass(frozen=True)
class Interface:
    name: str
    addresses: list[str] = field(default_factory=list)  # IPv4, global scope first
    up: bool = False


def parse_ip_addr(text: str) -> list[Interface]:
    try:
        data = json.loads(text)
    except ValueError as error:
        raise DiscoveryError(f"ip -j addr: not JSON: {error}") from None
    found = []
    for entry in data if isinstance(data, list) else []:
        infos = [i for i in entry.get("addr_info", []) if i.get("family") == "inet"]
        infos.sort(key=lambda i: i.get("scope") != "global")
        found.append(
            Interface(
                name=str(entry.get("ifname", "")),
                addresses=[str(i["local"]) for i in infos if "local" in i],
                up="UP" in entry.get("flags", []),
            )
        )
    return found


def parse_default_route(text: str) -> str | None:
    try:
        data = json.loads(text)
    except ValueError:
        return None
    for route in data if isinstance(data, list) else []:
        if route.get("dst") == "default" and route.get("dev"):
            return str(route["dev"])
    return None


@dataclass(frozen=True)
class Tried:
    """What the machine did when the agent tried (found by trying, not by a flag)."""

    wireguard_device: bool  # a tun device could be created (CAP_NET_ADMIN, /dev/net/tun)
    udp: bool  # a UDP socket could be opened and bound


def inventory_from(
    node: str,
    facts: MachineFacts,
    interfaces: list[Interface],
    default_interface: str | None,
    report: GpuReport | None,
    tried: Tried,
    numa_nodes: dict[str, int],
    network_namespace: str,
    warnings: list[str] | None = None,
) -> tuple[Inventory, list[str]]:
    """The inventory and the capabilities the agent announces (only those it has);
    `warnings`: what discovery did not understand besides the report's own."""
    by_name = {i.name: i for i in interfaces}
    underlay_name = facts.interface or default_interface
    underlay = by_name.get(underlay_name or "")
    if underlay is None or not underlay.addresses:
        have = ", ".join(f"{i.name} {i.addresses}" for i in interfaces if i.name != "lo")
        raise DiscoveryError(
            f"no address on the underlay interface {underlay_name or '(no default route)'}: "
            f"give --interface (interfaces: {have or 'none'})"
        )
    private_address = None
    private_interface = facts.private_interface or "eth1"
    if facts.private_network is not None:
        private = by_name.get(private_interface)
        if private is None or not private.addresses:
            raise DiscoveryError(
                f"private network {facts.private_network}: interface {private_interface} "
                "has no address (give --private-interface)"
            )
        private_address = private.addresses[0]
    vm = tried.wireguard_device and tried.udp
    capabilities = [*BASE_CAPABILITIES, *(["wireguard-device"] if vm else [])]
    return (
        Inventory(
            node=node,
            provider=facts.provider,
            region=facts.region,
            region_class=facts.region_class or facts.region,
            offering="vm" if vm else "container",
            address=underlay.addresses[0],
            pool=facts.pool,
            cluster=facts.cluster,
            accelerators=accelerators_of(report, numa_nodes, warnings),
            private_network=facts.private_network,
            private_address=private_address,
            private_interface=private_interface,
            network_namespace=network_namespace,
        ),
        capabilities,
    )


def accelerators(
    backend: Backend,
    model: str,
    devices: list[AcceleratorDevice],
    driver_version: str = "",
    runtime_version: str = "",
    warnings: list[str] | None = None,
) -> Accelerators:
    """What follows from the backend (C5): the collectives, the visible-devices variable."""
    return Accelerators(
        count=len(devices),
        backend=backend,
        model=model,
        collectives="nccl" if backend == "cuda" else "rccl",
        visible_devices_var="CUDA_VISIBLE_DEVICES" if backend == "cuda" else "HIP_VISIBLE_DEVICES",
        devices=devices,
        driver_version=driver_version,
        runtime_version=runtime_version,
        warnings=list(warnings or []),
    )


def device_name(backend: Backend, index: int) -> str:
    """C5: backend-derived device names, CUDA0 or ROCm0."""
    return f"{'CUDA' if backend == 'cuda' else 'ROCm'}{index}"


def accelerators_of(
    report: GpuReport | None, numa_nodes: dict[str, int], warnings: list[str] | None = None
) -> Accelerators:
    backend: Backend = report.backend if report is not None else "cuda"
    gpus = report.gpus if report is not None else []
    models = sorted({model_of(g.product) for g in gpus})
    if len(models) > 1:  # the placer matches one model per machine
        raise DiscoveryError(f"GPUs of several models on one machine: {', '.join(models)}")
    devices = [
        AcceleratorDevice(
            index=i,
            name=device_name(backend, i),
            numa_node=gpu.numa_node
            if gpu.numa_node is not None
            else max(numa_nodes.get(gpu.pci_bus_id, 0), 0),
            pcie_bus_id=gpu.pci_bus_id,
            memory_mib=gpu.memory_mib,
        )
        for i, gpu in enumerate(gpus)
    ]
    return accelerators(
        backend,
        models[0] if models else NO_ACCELERATORS,
        devices,
        report.driver_version if report is not None else "",
        report.runtime_version if report is not None else "",
        [*(warnings or []), *(report.warnings if report is not None else [])],
    )

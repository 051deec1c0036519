"""What this machine is (T1): read from the fleet file for the machines of the lab (`nodus up`);
a real machine describes itself (services/agent/discover.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from libs.contracts.fleet import (
    AcceleratorDevice,
    Inventory,
    Machine,
)
from libs.discovery.machine import BASE_CAPABILITIES, accelerators, device_name


@dataclass(frozen=True)
class Described:
    """A machine that described itself: its inventory and the capabilities it has."""

    inventory: Inventory
    capabilities: list[str]


def network_namespace() -> str:
    """Loopback reaches exactly the processes of one network namespace on one kernel (C4)."""
    try:
        machine_id = Path("/etc/machine-id").read_text().strip()
    except OSError:
        machine_id = "unknown"
    try:
        netns = os.readlink("/proc/self/ns/net")
    except OSError:
        netns = "unknown"
    return f"{machine_id}:{netns}"


def inventory_of(machine: Machine) -> Inventory:
    acc = machine.accelerators
    devices = [
        AcceleratorDevice(
            index=i, name=device_name(acc.backend, i), numa_node=i * 2 // max(acc.count, 1)
        )
        for i in range(acc.count)
    ]
    return Inventory(
        node=machine.name,
        provider=machine.provider,
        region=machine.region,
        region_class=machine.region_class,
        offering=machine.offering,
        address=machine.address,
        pool=machine.pool,
        cluster=machine.cluster,
        accelerators=accelerators(acc.backend, acc.model, devices),
        private_network=machine.private_network,
        private_address=machine.private_address,
        private_interface=machine.private_interface,
        network_namespace=network_namespace(),
    )


def capabilities_of(machine: Machine) -> list[str]:
    # A VM can create the nodus0 WireGuard device; a container-only offering cannot (G6).
    extra = ["wireguard-device"] if machine.offering == "vm" else []
    return [*BASE_CAPABILITIES, *extra]

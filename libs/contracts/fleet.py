"""The fleet file that `nodus up --fleet` reads, and the inventory agents register (T1, C6)."""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from libs.contracts.base import Name, Record
from libs.contracts.bounds import TUNNEL_BUFFER_LIMIT_BYTES
from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.files import load_yaml_file
from libs.contracts.jobs import Backend
from libs.contracts.names import SOCKS_ENDPOINT

Offering = Literal["vm", "container"]


class MachineAccelerators(Record):
    count: Annotated[int, msgspec.Meta(ge=0, le=64)]
    backend: Backend
    model: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]


class Machine(Record):
    name: Name
    provider: Name
    region: Name
    region_class: Name
    offering: Offering
    address: str
    pool: Name
    cluster: Name
    accelerators: MachineAccelerators
    private_network: Name | None = None
    private_address: str | None = None
    # Interface that carries the private network; NCCL/Gloo use it on the Private path.
    private_interface: Annotated[str, msgspec.Meta(pattern=r"^[a-zA-Z0-9_.-]{1,15}$")] = "eth1"
    # Behind its provider's NAT: `address` is private, and peers see the NAT's public address
    # (the network-namespace lab builds the NAT router; on real machines it is the provider's).
    nat: bool = False


class Fleet(Record):
    machines: Annotated[list[Machine], msgspec.Meta(min_length=1)]


class AcceleratorDevice(Record):
    index: int
    name: str  # backend-derived: CUDA0, ROCm0 (C5)
    numa_node: int = 0
    pcie_bus_id: str = ""
    memory_mib: int = 0  # discovered machines (O1); 0 when not known


class Accelerators(Record):
    count: int
    backend: Backend
    model: str
    collectives: Literal["nccl", "rccl"]
    visible_devices_var: Literal["CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"]
    devices: list[AcceleratorDevice] = []
    driver_version: str = ""  # discovered machines (O1)
    runtime_version: str = ""  # CUDA or ROCm
    # What discovery did not understand or could not read (a unit, a value the tool did not
    # report, a tool that failed), said plainly; empty on a machine it read whole (O1).
    warnings: list[str] = []


class Inventory(Record):
    """What a node agent registers (T1)."""

    node: Name
    provider: Name
    region: Name
    region_class: Name
    offering: Offering
    address: str  # eth0
    pool: Name
    cluster: Name
    accelerators: Accelerators
    private_network: Name | None = None
    private_address: str | None = None
    private_interface: str = "eth1"
    # Loopback addresses reach between nodes only inside one network namespace (C4).
    network_namespace: str = ""


class WireGuardInfo(Record):
    """Which WireGuard a VM's `nodus0` runs (O5)."""

    implementation: Literal["kernel", "wireguard-go"]
    # The module's version, or the wireguard-go package's (dpkg; its --version may lag).
    version: str
    # TUN TSO/GRO and UDP GSO/GRO: the kernel has them; wireguard-go since 0.0.20230223.
    offloads: bool
    binary: str = ""  # wireguard-go's path


class NodeRecord(Record):
    """One node in the cluster view: inventory, version and capabilities (C6)."""

    inventory: Inventory
    agent_version: str
    capabilities: list[str]
    registered_time: datetime
    boot_id: str = ""
    # Where the agent serves SOCKS5 to the shim of its ranks (G8 NODUS_NETSHIM_SOCKS).
    socks_endpoint: str = SOCKS_ENDPOINT
    # The most memory the agent gives one member's tunnel buffers; plans needing more are
    # refused (C3).
    tunnel_buffer_limit_bytes: int = TUNNEL_BUFFER_LIMIT_BYTES
    # The WireGuard its nodus0 runs; None: this agent makes no nodus0 (a container, no netns).
    wireguard: WireGuardInfo | None = None


class NodeHealth(Record):
    """The heartbeat, kept apart from the inventory so beats stay small."""

    node: Name
    healthy: bool
    heartbeat_time: datetime
    boot_id: str = ""
    reasons: list[str] = []
    # What the agent keeps trying and failing to converge to, one line each (an epoch whose
    # dataplane does not start, and when it tries next): `nodus get nodes` shows it.
    failing: list[str] = []


def load_fleet(path: Path) -> Fleet:
    """Parse a fleet file; every error names the file and the field (S3)."""
    fleet = load_yaml_file(path, Fleet, "fleet")
    seen: set[str] = set()
    for machine in fleet.machines:
        if machine.name in seen:
            raise NodusError(
                ErrorCode.INVALID, f"fleet {path}: machine {machine.name} listed twice"
            )
        seen.add(machine.name)
        if bool(machine.private_network) != bool(machine.private_address):
            raise NodusError(
                ErrorCode.INVALID,
                f"fleet {path}: machine {machine.name}: privateNetwork and privateAddress go together",
            )
    return fleet


class MachineFacts(Record):
    """What the platform must be told: /etc/nodus/machine.yaml, each field a flag too."""

    provider: Name
    region: Name
    region_class: Name | None = None  # the region, when not given
    pool: Name = "default"
    cluster: Name = "default"
    interface: str | None = None  # the underlay; default: the default route's
    private_network: Name | None = None
    private_interface: Annotated[str, msgspec.Meta(pattern=r"^[a-zA-Z0-9_.-]{1,15}$")] | None = None

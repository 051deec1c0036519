"""Placement, sans-I/O: from a job and the cluster view to a plan, or the reasons there is none.

One member per machine, all members chosen at once (G3), inside the job's network scope (G4),
on the best path class its transport accepts (G5, G6, G19), on qualified offering combinations
(G21), with distinct, routable advertised addresses (G7, C4), members that announce what the
path needs (C6), and one accelerator backend per gang (C5).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from libs.contracts.bounds import RELATIVE_TO_DIRECT
from libs.contracts.errors import ErrorCode
from libs.contracts.fleet import Inventory, NodeRecord
from libs.contracts.jobs import Job, PathClass
from services.placer.config import PlacerConfig

PATH_ORDER = (PathClass.PRIVATE, PathClass.DIRECT, PathClass.RELAYED)
MESH_NETWORK = ipaddress.IPv4Network("100.64.0.0/10")


@dataclass(frozen=True, slots=True)
class PlannedMember:
    rank: int
    node: str
    address: str  # advertised (G7)
    interface: str


@dataclass(frozen=True, slots=True)
class Plan:
    path: PathClass
    members: tuple[PlannedMember, ...]

    @property
    def nodes(self) -> list[str]:
        return [member.node for member in self.members]


@dataclass(frozen=True, slots=True)
class Shortfall:
    """Why one path could not be planned: a stable code and a sentence for the user."""

    path: PathClass
    code: ErrorCode
    message: str


@dataclass(slots=True)
class Exclusions:
    """What one job must avoid while it is re-placed (collisions, failed pairs)."""

    nodes: set[str] = field(default_factory=set)
    addresses: set[str] = field(default_factory=set)


def address_problem(address: str) -> str | None:
    """C4: an advertised address must be a real unicast address."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return f"{address!r} is not an IP address"
    if ip.is_unspecified:
        return f"{address} is unspecified"
    if ip.is_multicast:
        return f"{address} is multicast"
    return None


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def mesh_addresses(mesh_id: str, members: int) -> list[str]:
    """Direct path: per-epoch addresses in 100.64.0.0/10, one /24 chosen by the mesh id."""
    subnets = MESH_NETWORK.num_addresses // 256
    subnet = int(mesh_id[:8], 16) % subnets
    base = int(MESH_NETWORK.network_address) + subnet * 256
    return [str(ipaddress.IPv4Address(base + rank + 1)) for rank in range(members)]


def _matches(pattern: str, inv: Inventory) -> bool:
    if "/" in pattern:
        provider, offering = pattern.split("/", 1)
    else:
        provider, offering = "*", pattern
    return provider in ("*", inv.provider) and offering in ("*", inv.offering)


def pair_qualified(patterns: Iterable[str], a: Inventory, b: Inventory) -> bool:
    for pattern in patterns:
        left, right = pattern.split("+", 1)
        if (_matches(left, a) and _matches(right, b)) or (_matches(left, b) and _matches(right, a)):
            return True
    return False


class Planner:
    """Pure placement over a cluster view; the asyncio shell owns the view and the commits."""

    def __init__(self, config: PlacerConfig) -> None:
        self.config = config

    # -- which paths a job may use -------------------------------------------------------------

    def paths_for(self, job: Job) -> tuple[list[PathClass], list[Shortfall]]:
        distributed = job.spec.distributed
        paths = [PathClass.PRIVATE, PathClass.DIRECT]
        shortfalls: list[Shortfall] = []
        if distributed.transport == "Auto":
            if distributed.members <= self.config.relayed_max_members:
                paths.append(PathClass.RELAYED)
            else:
                shortfalls.append(
                    Shortfall(
                        PathClass.RELAYED,
                        ErrorCode.RELAYED_MEMBERS,
                        f"Relayed gangs have at most {self.config.relayed_max_members} members "
                        f"until multi-member Relayed is qualified; this gang has {distributed.members}",
                    )
                )
        # G19: compare placements by the assumed throughput; ties keep the order above.
        paths.sort(key=lambda path: -RELATIVE_TO_DIRECT[path])
        return paths, shortfalls

    # -- candidates ----------------------------------------------------------------------------

    def _missing_capabilities(self, record: NodeRecord, path: PathClass) -> list[str]:
        required = self.config.required_capabilities
        needed = [*required.all, *getattr(required, path.value)]
        return [cap for cap in needed if cap not in record.capabilities]

    def eligible(self, job: Job, record: NodeRecord) -> bool:
        """Accelerators as requested (count at least, backend and model equal where given)."""
        want = job.spec.accelerators
        have = record.inventory.accelerators
        if have.count < want.count:
            return False
        if want.backend is not None and have.backend != want.backend:
            return False
        return want.model is None or have.model == want.model

    def _group_key(self, job: Job, inv: Inventory, path: PathClass) -> tuple[str, ...] | None:
        """Members of one gang share a group: one scope (G4), one backend (C5), and for
        loopback addresses one network namespace (C4). None: not usable on this path."""
        network = job.spec.distributed.network
        if path is PathClass.PRIVATE:
            # Private: one provider region with a private network, whatever the scope.
            if not inv.private_network or not inv.private_address:
                return None
            scope: tuple[str, ...] = (inv.provider, inv.region, inv.private_network)
            address = inv.private_address
        else:
            if network == "Colocated":
                scope = (inv.provider, inv.region)
            elif network == "Regional":
                scope = (inv.region_class,)
            else:
                scope = ()
            address = inv.address
        if path is PathClass.DIRECT:
            return (*scope, inv.accelerators.backend)
        if address_problem(address) is not None:
            return None
        namespace = inv.network_namespace if is_loopback(address) else ""
        if is_loopback(address) and not namespace:
            return None
        return (*scope, inv.accelerators.backend, namespace)

    # -- planning ------------------------------------------------------------------------------

    def plan(
        self,
        job: Job,
        free: Collection[NodeRecord],
        exclusions: Exclusions | None = None,
        mesh_id: str = "0" * 32,
    ) -> tuple[Plan | None, list[Shortfall]]:
        """The best plan over the free nodes, or the shortfall of every path tried."""
        exclusions = exclusions or Exclusions()
        members = job.spec.distributed.members
        paths, shortfalls = self.paths_for(job)
        for path in paths:
            plan, shortfall = self._plan_path(job, path, free, members, exclusions, mesh_id)
            if plan is not None:
                return plan, []
            shortfalls.append(shortfall)
        if not any(
            record.inventory.node not in exclusions.nodes and self.eligible(job, record)
            for record in free
        ):
            want = job.spec.accelerators
            what = " ".join(
                part
                for part in (
                    f"{want.count}x" if want.count else "",
                    want.backend or "",
                    want.model or "",
                )
                if part
            )
            shortfalls.insert(
                0,
                Shortfall(
                    paths[0],
                    ErrorCode.UNSATISFIABLE,
                    f"no available machine has the accelerators asked for ({what or 'any'})",
                ),
            )
        return None, shortfalls

    def _plan_path(
        self,
        job: Job,
        path: PathClass,
        free: Collection[NodeRecord],
        members: int,
        exclusions: Exclusions,
        mesh_id: str,
    ) -> tuple[Plan | None, Shortfall]:
        patterns = getattr(self.config.qualified, path.value)
        groups: dict[tuple[str, ...], list[NodeRecord]] = {}
        usable = capable = 0
        best = 0
        for record in free:
            inv = record.inventory
            if path is PathClass.DIRECT and inv.offering != "vm":
                continue
            if inv.node in exclusions.nodes or not self.eligible(job, record):
                continue
            key = self._group_key(job, inv, path)
            if key is None:
                continue
            usable += 1
            if self._missing_capabilities(record, path):
                continue
            capable += 1
            advertised = inv.private_address if path is PathClass.PRIVATE else inv.address
            if path is not PathClass.DIRECT and advertised in exclusions.addresses:
                continue
            group = groups.setdefault(key, [])
            if path is not PathClass.DIRECT and any(
                (m.inventory.private_address if path is PathClass.PRIVATE else m.inventory.address)
                == advertised
                for m in group
            ):
                continue  # G7/C4: advertised addresses are distinct within a gang
            if not all(pair_qualified(patterns, inv, m.inventory) for m in group):
                continue
            group.append(record)
            best = max(best, len(group))
            if len(group) == members and self._path_holds(path, group):
                return self._build(path, group, mesh_id), Shortfall(path, ErrorCode.INVALID, "")
            if len(group) == members:
                group.pop()  # a Relayed gang needs a member without a network device
                best = max(best, len(group))
        return None, self._explain(job, path, members, usable, capable, best, patterns)

    @staticmethod
    def _path_holds(path: PathClass, group: list[NodeRecord]) -> bool:
        # G6: Relayed is chosen when a member has no network device; all-VM gangs go Direct.
        if path is PathClass.RELAYED:
            return any(record.inventory.offering == "container" for record in group)
        return True

    def _build(self, path: PathClass, group: list[NodeRecord], mesh_id: str) -> Plan:
        group = sorted(group, key=lambda record: record.inventory.node)  # stable rank order
        if path is PathClass.DIRECT:
            addresses = mesh_addresses(mesh_id, len(group))
            planned = [
                PlannedMember(rank, record.inventory.node, addresses[rank], "nodus0")
                for rank, record in enumerate(group)
            ]
        elif path is PathClass.PRIVATE:
            planned = [
                PlannedMember(
                    rank,
                    record.inventory.node,
                    record.inventory.private_address or "",
                    record.inventory.private_interface,
                )
                for rank, record in enumerate(group)
            ]
        else:
            planned = [
                PlannedMember(rank, record.inventory.node, record.inventory.address, "eth0")
                for rank, record in enumerate(group)
            ]
        return Plan(path, tuple(planned))

    def _explain(
        self,
        job: Job,
        path: PathClass,
        members: int,
        usable: int,
        capable: int,
        best: int,
        patterns: list[str],
    ) -> Shortfall:
        network = job.spec.distributed.network
        where = {
            PathClass.PRIVATE: "in one provider region with a private network",
            PathClass.DIRECT: f"that are VMs ({network} scope)",
            PathClass.RELAYED: f"({network} scope) including a container-only machine",
        }[path]
        if usable and not capable:
            needed = sorted(
                {
                    *self.config.required_capabilities.all,
                    *getattr(self.config.required_capabilities, path.value),
                }
            )
            return Shortfall(
                path,
                ErrorCode.MISSING_CAPABILITY,
                f"{path.value}: no machine {where} announces the capabilities "
                f"{', '.join(needed)} (C6: upgrade their agents)",
            )
        if not patterns:
            return Shortfall(
                path, ErrorCode.NOT_QUALIFIED, f"{path.value}: no offering combination is qualified"
            )
        return Shortfall(
            path,
            ErrorCode.UNSATISFIABLE,
            f"{path.value}: needs {members} machines {where} with one accelerator backend, "
            f"distinct addresses and a qualified combination ({', '.join(patterns)}); "
            f"at most {best} found",
        )


def check_plan(plan: Plan, records: dict[str, NodeRecord], job: Job) -> list[str]:
    """Invariants every plan keeps (G3, G4, G6, G7, C4, C5); checked before a commit and by
    the property tests."""
    problems: list[str] = []
    nodes = plan.nodes
    inventories = [records[node].inventory for node in nodes]
    if len(nodes) != job.spec.distributed.members:
        problems.append(f"plan has {len(nodes)} members, the job asks for {job.spec.distributed.members}")
    if len(set(nodes)) != len(nodes):
        problems.append("a machine appears twice in the gang (G3)")
    addresses = [member.address for member in plan.members]
    if len(set(addresses)) != len(addresses):
        problems.append(f"duplicate advertised addresses {addresses} (G7, C4)")
    for member in plan.members:
        problem = address_problem(member.address)
        if problem:
            problems.append(f"rank {member.rank}: {problem} (C4)")
    if any(is_loopback(a) for a in addresses):
        namespaces = {inv.network_namespace for inv in inventories}
        if len(namespaces) != 1 or "" in namespaces:
            problems.append("loopback address in a gang that spans network namespaces (C4)")
    if len({inv.accelerators.backend for inv in inventories}) > 1:
        problems.append("members mix accelerator backends (C5)")
    network = job.spec.distributed.network
    if plan.path is PathClass.PRIVATE:
        scopes = {(inv.provider, inv.region, inv.private_network) for inv in inventories}
        if len(scopes) != 1 or any(inv.private_network is None for inv in inventories):
            problems.append("Private gang outside one provider region's private network (G6)")
    elif network == "Colocated" and len({(i.provider, i.region) for i in inventories}) != 1:
        problems.append("Colocated gang spans provider regions (G4)")
    elif network == "Regional" and len({i.region_class for i in inventories}) != 1:
        problems.append("Regional gang spans region classes (G4)")
    if plan.path is PathClass.DIRECT and any(inv.offering != "vm" for inv in inventories):
        problems.append("Direct gang with a member that cannot create a WireGuard device (G6)")
    if plan.path is PathClass.RELAYED:
        if job.spec.distributed.transport != "Auto":
            problems.append("Relayed gang for a job whose transport is Direct (G5)")
        if all(inv.offering == "vm" for inv in inventories):
            problems.append("Relayed gang of VMs only: it should be Direct (G6)")
    if plan.path is PathClass.DIRECT:
        if not all(ipaddress.ip_address(a) in MESH_NETWORK for a in addresses):
            problems.append("Direct addresses outside 100.64.0.0/10 (G7)")
    else:
        expected = [
            inv.private_address if plan.path is PathClass.PRIVATE else inv.address
            for inv in inventories
        ]
        if addresses != expected:
            problems.append(f"advertised addresses {addresses} are not the members' own (G7)")
    return problems

"""The invariants every plan keeps, checked before a commit and by the property tests."""

from __future__ import annotations

import ipaddress

from libs.contracts.fleet import NodeRecord
from libs.contracts.jobs import Job, PathClass
from services.placer.addresses import MESH_NETWORK, address_problem, ip_family, is_loopback
from services.placer.planner import Plan


def check_plan(plan: Plan, records: dict[str, NodeRecord], job: Job) -> list[str]:
    """Invariants every plan keeps (G3, G4, G6, G7, C4, C5); checked before a commit and by
    the property tests."""
    problems: list[str] = []
    nodes = plan.nodes
    inventories = [records[node].inventory for node in nodes]
    if len(nodes) != job.spec.distributed.members:
        problems.append(
            f"plan has {len(nodes)} members, the job asks for {job.spec.distributed.members}"
        )
    if len(set(nodes)) != len(nodes):
        problems.append("a machine appears twice in the gang (G3)")
    addresses = [member.address for member in plan.members]
    if len(set(addresses)) != len(addresses):
        problems.append(f"duplicate advertised addresses {addresses} (G7, C4)")
    for member in plan.members:
        problem = address_problem(member.address)
        if problem:
            problems.append(f"rank {member.rank}: {problem} (C4)")
    if len({ip_family(a) for a in addresses}) > 1:
        problems.append(f"advertised addresses {addresses} mix IP families (C4)")
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
        if (
            all(inv.offering == "vm" for inv in inventories)
            and job.status.path_override is not PathClass.RELAYED
            and job.spec.qualify is None  # measuring Relayed between VMs is allowed
        ):
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

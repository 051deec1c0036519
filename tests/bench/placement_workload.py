"""The placement bench's workload: a generated fleet shaped like a mixed real one (providers,
regions, private networks, container marketplaces, CUDA and ROCm, a scarce model) and a
burst of jobs over it, both from one seeded random generator. See tests/bench/placement.py."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from libs.contracts.fleet import NodeRecord
from libs.contracts.jobs import Job
from tests.factories import job as make_job
from tests.factories import machine as make_machine
from tests.factories import node_record

# -- the fleet ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pool:
    provider: str
    region: str
    region_class: str
    offering: str
    private_network: str | None
    backend: str
    model: str
    count: int
    weight: float


# Providers, regions and region classes as a mixed real fleet has them: VMs on a VPC (Private
# gangs), VMs without a private network (Direct), container-only marketplaces (Relayed), CUDA
# and ROCm. Under a third of the machines have a private network: the Private path, tried
# first, runs out and Direct takes over.
POOLS = [
    Pool("aws", "us-east-1", "us", "vm", "aws-use1-vpc", "cuda", "H100", 8, 8),
    Pool("aws", "us-east-1", "us", "vm", "aws-use1-vpc", "cuda", "A100", 8, 4),
    Pool("aws", "us-west-2", "us", "vm", None, "cuda", "H100", 8, 5),
    Pool("aws", "us-west-2", "us", "vm", None, "cuda", "L4", 1, 3),
    Pool("aws", "eu-west-1", "eu", "vm", "aws-euw1-vpc", "cuda", "A100", 8, 4),
    Pool("aws", "ap-northeast-1", "ap", "vm", None, "cuda", "H100", 8, 3),
    Pool("gcp", "us-central1", "us", "vm", None, "cuda", "H100", 8, 6),
    Pool("gcp", "us-central1", "us", "vm", None, "cuda", "L4", 1, 3),
    Pool("gcp", "europe-west4", "eu", "vm", None, "cuda", "A100", 8, 4),
    Pool("gcp", "asia-southeast1", "ap", "vm", "gcp-asse1-vpc", "cuda", "L4", 1, 2),
    Pool("azure", "eastus", "us", "vm", "az-eastus-vnet", "rocm", "MI300X", 8, 5),
    Pool("azure", "eastus", "us", "vm", "az-eastus-vnet", "cuda", "H100", 8, 4),
    Pool("azure", "westeurope", "eu", "vm", "az-weu-vnet", "rocm", "MI300X", 8, 4),
    Pool("lambda", "us-west-1", "us", "vm", None, "cuda", "H100", 8, 5),
    Pool("lambda", "us-west-1", "us", "vm", None, "cuda", "A100", 8, 4),
    Pool("lambda", "eu-central-1", "eu", "vm", None, "cuda", "A100", 8, 3),
    Pool("coreweave", "us-east-4", "us", "vm", None, "cuda", "H100", 8, 6),
    Pool("tensorwave", "us-west-3", "us", "vm", None, "rocm", "MI300X", 8, 4),
    Pool("vast", "us-east-2", "us", "container", None, "cuda", "RTX4090", 1, 5),
    Pool("vast", "eu-south-1", "eu", "container", None, "cuda", "RTX4090", 1, 3),
    Pool("vast", "ap-south-1", "ap", "container", None, "cuda", "A100", 8, 2),
    Pool("runpod", "us-texas-1", "us", "container", None, "cuda", "H100", 8, 3),
    Pool("runpod", "eu-ro-1", "eu", "container", None, "rocm", "MI300X", 8, 2),
]
# A scarce model, a fixed number of machines whatever the fleet size: the jobs asking for it
# outnumber it, so some are left Unschedulable (a decision too, and the costliest: every path
# scans the whole free view).
SCARCE = Pool("coreweave", "us-east-4", "us", "vm", None, "cuda", "B200", 8, 0)
SCARCE_MACHINES = 24
# Share of VMs whose agent is older and lacks `wireguard-device` (C6): Private path only. It
# reads no join key naming every member either: its gangs get a one-member key each.
OLD_AGENT_SHARE = 0.02
OLD_AGENT_CAPABILITIES = ["register", "heartbeat", "join-epoch"]


def _address(index: int, first: int, second_base: int) -> str:
    """Unique unicast addresses: index -> first.(second_base + hi).mid.low, low in 1..250."""
    block, low = divmod(index, 250)
    hi, mid = divmod(block, 250)
    return f"{first}.{second_base + hi}.{mid}.{low + 1}"


def build_fleet(machines: int, rng: random.Random) -> list[NodeRecord]:
    """`machines` node records over POOLS (plus the scarce pool), in a random order."""
    scarce = min(SCARCE_MACHINES, max(0, machines // 40))
    rest = machines - scarce
    total_weight = sum(p.weight for p in POOLS)
    counts = [int(rest * p.weight / total_weight) for p in POOLS]
    for i in range(rest - sum(counts)):  # the remainder, one each from the first pools
        counts[i % len(counts)] += 1
    plan = [(p, n) for p, n in zip(POOLS, counts, strict=True)] + [(SCARCE, scarce)]
    specs: list[tuple[Pool, int]] = []
    for pool, n in plan:
        specs.extend((pool, i) for i in range(n))
    rng.shuffle(specs)  # agents register in no particular order
    records: list[NodeRecord] = []
    per_pool: Counter[str] = Counter()
    for index, (pool, _) in enumerate(specs):
        prefix = f"{pool.provider}-{pool.region}-{pool.model.lower()}"
        per_pool[prefix] += 1
        fields: dict[str, Any] = {
            "provider": pool.provider,
            "region": pool.region,
            "regionClass": pool.region_class,
            "offering": pool.offering,
            "address": _address(index, 10, 0),
            "pool": f"{pool.model.lower()}-{pool.region_class}",
            "cluster": f"{pool.provider}-{pool.region}",
            "accelerators": {"count": pool.count, "backend": pool.backend, "model": pool.model},
        }
        if pool.private_network:
            fields["privateNetwork"] = pool.private_network
            fields["privateAddress"] = _address(index, 172, 16)
            fields["privateInterface"] = "ens5"
        m = make_machine(f"{prefix}-{per_pool[prefix]:05d}", **fields)
        capabilities = None
        if pool.offering == "vm" and rng.random() < OLD_AGENT_SHARE:
            capabilities = list(OLD_AGENT_CAPABILITIES)
        records.append(
            node_record(m, capabilities=capabilities, namespace=f"netns-{pool.provider}")
        )
    return records


def fleet_summary(records: list[NodeRecord]) -> dict[str, Any]:
    invs = [r.inventory for r in records]
    return {
        "machines": len(records),
        "providers": len({i.provider for i in invs}),
        "regions": len({(i.provider, i.region) for i in invs}),
        "region_classes": sorted({i.region_class for i in invs}),
        "private_networks": len({i.private_network for i in invs if i.private_network}),
        "offering": dict(Counter(i.offering for i in invs)),
        "backend": dict(Counter(i.accelerators.backend for i in invs)),
        "with_private_network": sum(1 for i in invs if i.private_network),
        "without_wireguard_capability": sum(
            1
            for r in records
            if r.inventory.offering == "vm" and "wireguard-device" not in r.capabilities
        ),
        "unique_addresses": len({i.address for i in invs}) == len(invs),
    }


# -- the jobs ----------------------------------------------------------------------------------

ORGS = ["acme", "globex", "initech", "umbrella", "hooli"]
# (weight, accelerators, fixed members or None, fixed network or None, fixed transport or None)
JOB_SHAPES: list[tuple[float, dict[str, Any], int | None, str | None, str | None]] = [
    (20, {}, None, None, None),
    (22, {"backend": "cuda"}, None, None, None),
    (22, {"count": 8, "backend": "cuda", "model": "H100"}, None, None, None),
    (10, {"count": 8, "model": "A100"}, None, None, None),
    (8, {"count": 8, "backend": "rocm", "model": "MI300X"}, None, None, None),
    (4, {"backend": "rocm"}, None, None, None),
    (5, {"count": 1, "model": "L4"}, None, None, None),
    # Only container-only machines have RTX4090s: two members, transport Auto -> Relayed.
    (8, {"count": 1, "model": "RTX4090"}, 2, None, "Auto"),
    # More demand than SCARCE_MACHINES: some of these are left Unschedulable.
    (2, {"count": 8, "model": "B200"}, None, "Colocated", "Direct"),
]
MEMBERS = [(2, 30), (3, 10), (4, 25), (5, 5), (6, 10), (7, 5), (8, 15)]
NETWORKS = [("Colocated", 40), ("Regional", 35), ("Global", 25)]
TRANSPORTS = [("Direct", 60), ("Auto", 40)]


def _pick(rng: random.Random, weighted: Sequence[tuple[Any, float]]) -> Any:
    return rng.choices([v for v, _ in weighted], weights=[w for _, w in weighted])[0]


def build_jobs(count: int, rng: random.Random, prefix: str = "bench") -> list[Job]:
    jobs: list[Job] = []
    shapes = [(shape, shape[0]) for shape in JOB_SHAPES]
    for i in range(count):
        _, accelerators, members, network, transport = _pick(rng, shapes)
        members = members or _pick(rng, MEMBERS)
        env = {"NCCL_DEBUG": "WARN", "BENCH_INDEX": str(i)}
        if rng.random() < 0.3:
            env["NCCL_MIN_NCHANNELS"] = "4"
        jobs.append(
            make_job(
                f"{prefix}-{i:05d}",
                org=ORGS[i % len(ORGS)],
                command=["torchrun", "train.py", f"--seed={i}"],
                distributed={
                    "members": members,
                    "network": network or _pick(rng, NETWORKS),
                    "transport": transport or _pick(rng, TRANSPORTS),
                },
                accelerators=accelerators,
                env=env,
            )
        )
    return jobs


def job_summary(jobs: list[Job]) -> dict[str, Any]:
    members = [j.spec.distributed.members for j in jobs]
    return {
        "jobs": len(jobs),
        "members_total": sum(members),
        "members": dict(sorted(Counter(members).items())),
        "network": dict(Counter(j.spec.distributed.network for j in jobs)),
        "transport": dict(Counter(j.spec.distributed.transport for j in jobs)),
    }

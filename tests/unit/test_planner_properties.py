"""Property tests of the planner on random fleets and jobs.

1. Every plan the Planner returns keeps the invariants of `check_plan` (G3, G4, G6, G7, C4, C5)
   and gives each rank a distinct NODE_RANK and one MASTER_ADDR.
2. No false "unschedulable": an exhaustive search over small fleets, written from SPEC.md and
   independently of the planner, finds a valid gang exactly when the Planner returns a plan,
   the Planner picks the best path class that exists (Private, then Direct, then Relayed: G6,
   G19), and its gang is valid by the same independent rules.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from itertools import combinations
from typing import Any

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from libs.contracts.fleet import Inventory, NodeRecord
from libs.contracts.jobs import Job, PathClass
from libs.contracts.placer import PlacerConfig
from services.placer.config import load_config
from services.placer.environment import rank_environments
from services.placer.invariants import check_plan
from services.placer.planner import Exclusions, Planner
from tests.factories import job, machine, node_record

SETTINGS = settings(
    max_examples=int(__import__("os").environ.get("NODUS_PROPERTY_EXAMPLES", "200")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

# A provider region belongs to one region class.
REGIONS = {"us-east-1": "us", "us-west-2": "us", "eu-west-1": "eu"}
ADDRESSES = [
    "10.0.0.1",
    "10.0.0.2",
    "10.0.0.3",
    "10.0.1.4",
    "192.168.7.5",
    "127.0.0.1",
    "127.0.0.2",
    "0.0.0.0",
    "::",
    "fd00::1",
    "::1",
]
PRIVATE_ADDRESSES = ["172.16.0.1", "172.16.0.2", "172.16.0.3", "172.16.0.4", "127.0.0.5", "0.0.0.0"]
NAMESPACES = ["", "ns-a", "ns-b"]
MODELS = {"cuda": ["H100", "A100"], "rocm": ["MI300X"]}
BASE_CAPS = ["register", "heartbeat", "join-epoch"]
CAPABILITY_SETS = {
    "announced": None,  # what the agent announces for its offering (VMs: wireguard-device)
    "base": BASE_CAPS,
    "old": ["register", "heartbeat"],
    "wg": [*BASE_CAPS, "wireguard-device"],
}
PATTERN_POOL = [
    "vm+vm",
    "container+vm",
    "container+container",
    "*+*",
    "aws/vm+*",
    "aws/vm+gcp/vm",
    "gcp/vm+gcp/vm",
    "azure/*+*",
    "gcp/container+vm",
    "container+aws/vm",
]


# -- scenarios: plain data, so failures print readably and examples can be written by hand -----


@dataclass
class Scenario:
    machines: list[dict[str, Any]]
    distributed: dict[str, Any]
    accelerators: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    excluded_nodes: list[str] = field(default_factory=list)
    excluded_addresses: list[str] = field(default_factory=list)

    def records(self) -> list[NodeRecord]:
        out = []
        for i, spec in enumerate(self.machines):
            spec = dict(spec)
            caps = CAPABILITY_SETS[spec.pop("caps")]
            namespace = spec.pop("namespace")
            out.append(
                node_record(machine(f"m{i}", **spec), capabilities=caps, namespace=namespace)
            )
        return out

    def job(self) -> Job:
        return job(distributed=self.distributed, accelerators=self.accelerators)

    def placer_config(self) -> PlacerConfig:
        cfg = load_config()
        cfg.relayed_max_members = self.config.get("relayedMaxMembers", cfg.relayed_max_members)
        for path in ("private", "direct", "relayed"):
            if path in self.config:
                setattr(cfg.qualified, path, list(self.config[path]))
        return cfg

    def exclusions(self) -> Exclusions:
        return Exclusions(nodes=set(self.excluded_nodes), addresses=set(self.excluded_addresses))


@st.composite
def machine_specs(draw: st.DrawFn) -> dict[str, Any]:
    region = draw(st.sampled_from(["us-east-1", "us-east-1", "us-west-2", "eu-west-1"]))
    backend = draw(st.sampled_from(["cuda", "cuda", "cuda", "rocm"]))
    spec: dict[str, Any] = {
        "provider": draw(st.sampled_from(["aws", "aws", "gcp", "azure"])),
        "region": region,
        "regionClass": REGIONS[region],
        "offering": draw(st.sampled_from(["vm", "container"])),
        # mostly usable addresses, sometimes a shared, loopback or unspecified one
        "address": draw(st.sampled_from(ADDRESSES[:5] * 3 + ADDRESSES[5:])),
        "accelerators": {
            "count": draw(st.sampled_from([8, 8, 8, 4, 1, 0])),
            "backend": backend,
            "model": draw(st.sampled_from(MODELS[backend])),
        },
        "namespace": draw(st.sampled_from(NAMESPACES)),
        "caps": draw(st.sampled_from(["announced", "announced", "announced", "base", "old", "wg"])),
    }
    if draw(st.booleans()):
        spec["privateNetwork"] = draw(st.sampled_from(["vpc-a", "vpc-b"]))
        spec["privateAddress"] = draw(
            st.sampled_from(PRIVATE_ADDRESSES[:4] * 3 + PRIVATE_ADDRESSES[4:])
        )
    return spec


@st.composite
def scenarios(draw: st.DrawFn, max_machines: int, vary_qualification: bool) -> Scenario:
    machines = draw(st.lists(machine_specs(), min_size=2, max_size=max_machines))
    members = draw(st.sampled_from([2, 2, 2, 3, 3, 4, 5, 8]))
    if draw(st.integers(0, 4)):  # mostly a gang the fleet is large enough for
        members = max(2, min(members, len(machines)))
    distributed = {
        "members": members,
        "network": draw(st.sampled_from(["Colocated", "Regional", "Global"])),
        "transport": draw(st.sampled_from(["Direct", "Auto"])),
    }
    accelerators: dict[str, Any] = {"count": draw(st.sampled_from([0, 1, 1, 1, 4]))}
    backend = draw(st.sampled_from([None, None, None, "cuda", "rocm"]))
    if backend:
        accelerators["backend"] = backend
    if draw(st.integers(0, 4)) == 0:
        accelerators["model"] = draw(st.sampled_from(["H100", "MI300X"]))
    config: dict[str, Any] = {"relayedMaxMembers": draw(st.integers(2, 4))}
    if vary_qualification:
        for path in ("private", "direct", "relayed"):
            if draw(st.booleans()):
                config[path] = draw(
                    st.lists(st.sampled_from(PATTERN_POOL), max_size=3, unique=True)
                )
    names = [f"m{i}" for i in range(len(machines))]
    excluded_nodes = (
        draw(st.lists(st.sampled_from(names), max_size=2, unique=True))
        if draw(st.integers(0, 3)) == 0
        else []
    )
    excluded_addresses = (
        draw(st.lists(st.sampled_from(ADDRESSES + PRIVATE_ADDRESSES), max_size=2, unique=True))
        if draw(st.integers(0, 3)) == 0
        else []
    )
    return Scenario(machines, distributed, accelerators, config, excluded_nodes, excluded_addresses)


# -- the independent rules (SPEC.md), used by the exhaustive search ----------------------------


def pattern_side_matches(side: str, inv: Inventory) -> bool:
    provider, _, offering = side.rpartition("/")
    return provider in ("", "*", inv.provider) and offering in ("*", inv.offering)


def pair_is_qualified(patterns: list[str], a: Inventory, b: Inventory) -> bool:
    """G21: `offering` or `provider/offering`, `*` for any, the pair in either order."""
    for pattern in patterns:
        left, right = pattern.split("+")
        if pattern_side_matches(left, a) and pattern_side_matches(right, b):
            return True
        if pattern_side_matches(left, b) and pattern_side_matches(right, a):
            return True
    return False


def routable(address: str) -> bool:
    """C4: a unicast IP address, not unspecified (loopback is judged per gang)."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return not (ip.is_unspecified or ip.is_multicast)


def accelerators_fit(record: NodeRecord, the_job: Job) -> bool:
    want = record.inventory.accelerators
    ask = the_job.spec.accelerators
    return (
        want.count >= ask.count
        and (ask.backend is None or ask.backend == want.backend)
        and (ask.model is None or ask.model == want.model)
    )


def in_scope(network: str, invs: list[Inventory]) -> bool:
    """G4."""
    if network == "Colocated":
        return len({(i.provider, i.region) for i in invs}) == 1
    if network == "Regional":
        return len({i.region_class for i in invs}) == 1
    return True


def valid_gang(
    path: PathClass, gang: list[NodeRecord], the_job: Job, cfg: PlacerConfig, excluded: Exclusions
) -> bool:
    distributed = the_job.spec.distributed
    invs = [r.inventory for r in gang]
    if len(gang) != distributed.members or len({i.node for i in invs}) != len(gang):
        return False  # G3
    if path is PathClass.RELAYED and (
        distributed.transport != "Auto" or len(gang) > cfg.relayed_max_members
    ):
        return False  # G2, G5
    needed = [*cfg.required_capabilities.all, *getattr(cfg.required_capabilities, path.value)]
    for record in gang:
        if record.inventory.node in excluded.nodes or not accelerators_fit(record, the_job):
            return False
        if any(cap not in record.capabilities for cap in needed):
            return False  # C6
    if len({i.accelerators.backend for i in invs}) != 1:
        return False  # C5
    patterns = getattr(cfg.qualified, path.value)
    if not all(pair_is_qualified(patterns, a, b) for a, b in combinations(invs, 2)):
        return False  # G21
    if not in_scope(distributed.network, invs):
        return False  # G4
    if path is PathClass.PRIVATE:
        if any(not i.private_network or not i.private_address for i in invs):
            return False
        if len({(i.provider, i.region, i.private_network) for i in invs}) != 1:
            return False  # G6: one provider region with a private network
        addresses = [i.private_address or "" for i in invs]
    elif path is PathClass.DIRECT:
        return all(i.offering == "vm" for i in invs)  # G6; mesh addresses are fresh (G7)
    else:
        if all(i.offering == "vm" for i in invs):
            return False  # G6: Relayed only when a member has no network device
        addresses = [i.address for i in invs]
    # G7, C4: advertised addresses are routable, distinct, not excluded (collisions) ...
    if not all(routable(a) for a in addresses) or len(set(addresses)) != len(addresses):
        return False
    if any(a in excluded.addresses for a in addresses):
        return False
    # ... of one IP family, so every rank's NCCL_SOCKET_FAMILY reaches every peer ...
    if len({ipaddress.ip_address(a).version for a in addresses}) != 1:
        return False
    # ... and loopback only when the whole gang sits in one known network namespace. (A gang
    # mixing loopback and other addresses is read conservatively as invalid.)
    if any(ipaddress.ip_address(a).is_loopback for a in addresses):
        if not all(ipaddress.ip_address(a).is_loopback for a in addresses):
            return False
        namespaces = {i.network_namespace for i in invs}
        if len(namespaces) != 1 or "" in namespaces:
            return False
    return True


def best_valid_path(
    records: list[NodeRecord], the_job: Job, cfg: PlacerConfig, excluded: Exclusions
) -> tuple[PathClass, list[NodeRecord]] | None:
    """Exhaustive: the best path class (Private, Direct, then Relayed) with some valid gang."""
    accepted = [PathClass.PRIVATE, PathClass.DIRECT]
    if the_job.spec.distributed.transport == "Auto":
        accepted.append(PathClass.RELAYED)
    for path in accepted:
        for gang in combinations(records, the_job.spec.distributed.members):
            if valid_gang(path, list(gang), the_job, cfg, excluded):
                return path, list(gang)
    return None


# -- property 1: invariants of every plan -------------------------------------------------------


@SETTINGS
@given(scenarios(max_machines=10, vary_qualification=True))
def test_every_plan_keeps_the_invariants_and_gives_consistent_rank_environments(
    scenario: Scenario,
) -> None:
    records = scenario.records()
    the_job = scenario.job()
    cfg = scenario.placer_config()
    plan, shortfalls = Planner(cfg).plan(
        the_job, records, scenario.exclusions(), "c0ffee00" + "0" * 24
    )
    if plan is None:
        assert shortfalls and all(s.message for s in shortfalls)
        return
    by_node = {r.inventory.node: r for r in records}
    assert check_plan(plan, by_node, the_job) == []
    envs = rank_environments(the_job, plan, by_node, 1, cfg.master_port, cfg.shim_path)
    assert len(envs) == the_job.spec.distributed.members
    assert sorted(int(env["NODE_RANK"]) for env in envs) == list(range(len(envs)))
    assert len({env["MASTER_ADDR"] for env in envs}) == 1
    assert envs[0]["MASTER_ADDR"] == plan.members[0].address
    assert {env["NODUS_GANG_TRANSPORT"] for env in envs} == {plan.path.value}


# -- property 2: the planner agrees with an exhaustive search ---------------------------------


def assert_agrees_with_exhaustive_search(scenario: Scenario) -> None:
    records = scenario.records()
    the_job = scenario.job()
    cfg = scenario.placer_config()
    excluded = scenario.exclusions()
    expected = best_valid_path(records, the_job, cfg, excluded)
    plan, shortfalls = Planner(cfg).plan(the_job, records, excluded, "0" * 32)
    if expected is None:
        assert plan is None, f"planned {plan} but no valid gang exists"
        return
    path, witness = expected
    assert plan is not None, (
        f"no plan, but {[r.inventory.node for r in witness]} is a valid {path.value} gang; "
        f"planner said {[s.message for s in shortfalls]}"
    )
    assert plan.path is path, f"planned {plan.path.value}, but a {path.value} gang exists"
    by_node = {r.inventory.node: r for r in records}
    assert valid_gang(plan.path, [by_node[n] for n in plan.nodes], the_job, cfg, excluded)


KNOWN_RELAYED_CASE = Scenario(
    # vm+vm is not qualified for Relayed and neither VM announces wireguard-device; m0 and m2
    # share 10.0.0.1. m1+m2 is a valid Relayed gang.
    machines=[
        {
            "provider": "aws",
            "region": "us-east-1",
            "regionClass": "us",
            "offering": "vm",
            "address": "10.0.0.1",
            "accelerators": {"count": 8, "backend": "cuda", "model": "H100"},
            "namespace": "ns-a",
            "caps": "base",
        },
        {
            "provider": "aws",
            "region": "us-east-1",
            "regionClass": "us",
            "offering": "vm",
            "address": "10.0.0.2",
            "accelerators": {"count": 8, "backend": "cuda", "model": "H100"},
            "namespace": "ns-a",
            "caps": "base",
        },
        {
            "provider": "aws",
            "region": "us-east-1",
            "regionClass": "us",
            "offering": "container",
            "address": "10.0.0.1",
            "accelerators": {"count": 8, "backend": "cuda", "model": "H100"},
            "namespace": "ns-a",
            "caps": "announced",
        },
    ],
    distributed={"members": 2, "network": "Global", "transport": "Auto"},
)


@SETTINGS
@example(KNOWN_RELAYED_CASE)
@given(scenarios(max_machines=7, vary_qualification=False))
def test_no_false_unschedulable_with_the_default_qualification(scenario: Scenario) -> None:
    assert_agrees_with_exhaustive_search(scenario)


def _vm(provider: str, address: str) -> dict[str, Any]:
    return {
        "provider": provider,
        "region": "us-east-1",
        "regionClass": "us",
        "offering": "vm",
        "address": address,
        "accelerators": {"count": 8, "backend": "cuda", "model": "H100"},
        "namespace": "ns-a",
        "caps": "announced",
    }


KNOWN_QUALIFIED_CASE = Scenario(
    # The aws VM comes first and pairs with gcp but not with azure; gcp+azure+azure is a gang
    # whose every pair is qualified.
    machines=[
        _vm("aws", "10.0.0.1"),
        _vm("gcp", "10.0.0.2"),
        _vm("azure", "10.0.0.3"),
        _vm("azure", "10.0.1.4"),
    ],
    distributed={"members": 3, "network": "Global", "transport": "Direct"},
    config={"direct": ["aws/vm+gcp/vm", "gcp/vm+azure/vm", "azure/vm+azure/vm"]},
)


@SETTINGS
@example(KNOWN_QUALIFIED_CASE)
@given(scenarios(max_machines=7, vary_qualification=True))
def test_no_false_unschedulable_with_any_qualification_table(scenario: Scenario) -> None:
    assert_agrees_with_exhaustive_search(scenario)

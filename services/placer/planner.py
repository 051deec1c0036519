"""Placement, sans-I/O: from a job and the cluster view to a plan, or the reasons there is none.

One member per machine, all members chosen at once (G3), inside the job's network scope (G4),
on the best path class its transport accepts (G5, G6, G19), on qualified offering combinations
(G21), with distinct, routable advertised addresses (G7, C4), members that announce what the
path needs (C6), and one accelerator backend per gang (C5).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Iterator
from dataclasses import dataclass, field

from libs.contracts.bounds import RELATIVE_TO_DIRECT, derive
from libs.contracts.errors import ErrorCode
from libs.contracts.fleet import Inventory, NodeRecord
from libs.contracts.jobs import Job, PathClass
from libs.contracts.placer import PlacerConfig
from libs.contracts.qualify import covered_pairs
from services.placer.addresses import mesh_addresses
from services.placer.candidates import Candidates, Facts


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


def _matches(pattern: str, provider: str, offering: str) -> bool:
    if "/" in pattern:
        want_provider, want_offering = pattern.split("/", 1)
    else:
        want_provider, want_offering = "*", pattern
    return want_provider in ("*", provider) and want_offering in ("*", offering)


def types_qualified(patterns: Iterable[str], a: tuple[str, str], b: tuple[str, str]) -> bool:
    """Is the pair of machine types (provider, offering) a qualified combination (G21)?"""
    for pattern in patterns:
        left, right = pattern.split("+", 1)
        if (_matches(left, *a) and _matches(right, *b)) or (
            _matches(left, *b) and _matches(right, *a)
        ):
            return True
    return False


# A search over a group that takes more steps than this gives up on the group (reported).
SEARCH_BUDGET = 20_000


class Planner:
    """Pure placement over a cluster view; the asyncio shell owns the view and the commits."""

    def __init__(self, config: PlacerConfig) -> None:
        self.config = config
        # Pairs of machine types measured per path (`nodus qualify`, nodus-qualifications),
        # each with the largest gang it was measured in: qualified beside the config's own
        # table, which stays as the operator's override (qualified_pairs).
        self.measured: dict[PathClass, dict[str, int]] = {}

    def qualified_patterns(self, job: Job, path: PathClass) -> list[str]:
        members = job.spec.distributed.members
        if job.spec.qualify is not None:  # a qualification run: its own pairs, measured now
            return covered_pairs(job.spec.qualify.offerings, members)
        measured = self.measured.get(path, {})
        if path is PathClass.RELAYED and members > self.config.relayed_max_members:
            # Issue 26: a Relayed gang larger than the operator allows outright runs only on
            # pairs measured in a gang at least as large.
            return sorted(p for p, most in measured.items() if most >= members)
        return [*getattr(self.config.qualified, path.value), *sorted(measured)]

    def relayed_sizes_qualified(self) -> int:
        """The largest Relayed gang any measured pair, or the operator's limit, admits."""
        measured = self.measured.get(PathClass.RELAYED, {})
        return max([self.config.relayed_max_members, *measured.values()])

    # -- which paths a job may use -------------------------------------------------------------

    def paths_for(self, job: Job) -> tuple[list[PathClass], list[Shortfall]]:
        distributed = job.spec.distributed
        if job.spec.qualify is not None:  # G21: a qualification run measures one path
            return [job.spec.qualify.path], []
        paths = [PathClass.PRIVATE, PathClass.DIRECT]
        shortfalls: list[Shortfall] = []
        if job.status.path_override is PathClass.RELAYED and distributed.transport == "Auto":
            paths = []  # G12: the direct path failed its probe, so Auto continues as Relayed
        if distributed.transport == "Auto":
            if distributed.members <= self.relayed_sizes_qualified():
                paths.append(PathClass.RELAYED)
            else:
                members = distributed.members
                shortfalls.append(
                    Shortfall(
                        PathClass.RELAYED,
                        ErrorCode.RELAYED_MEMBERS,
                        f"relayed: a Relayed gang of {members} members needs a qualification "
                        f"for at least {members} members on its offerings, and none is recorded "
                        f"(`nodus qualify --path relayed --members {members} --offerings A+B`; "
                        "the placer config's relayedMaxMembers, "
                        f"{self.config.relayed_max_members}, admits larger gangs outright)",
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

    def _scope(self, job: Job, inv: Inventory) -> tuple[str, ...]:
        network = job.spec.distributed.network
        if network == "Colocated":
            return (inv.provider, inv.region)
        if network == "Regional":
            return (inv.region_class,)
        return ()

    def _group_key(
        self, job: Job, inv: Inventory, facts: Facts, path: PathClass
    ) -> tuple[object, ...] | None:
        """Members of one gang share a group: one scope (G4), one backend (C5), one IP family,
        and for loopback addresses one network namespace (C4). None: unusable on this path."""
        backend = inv.accelerators.backend
        if path is PathClass.PRIVATE:
            # Private: one provider region with a private network, whatever the scope.
            if not facts.private_usable:
                return None
            return (
                inv.provider,
                inv.region,
                inv.private_network,
                backend,
                facts.private_family,
                facts.private_namespace,
            )
        if path is PathClass.DIRECT:
            return (*self._scope(job, inv), backend)
        if not facts.eth0_usable:
            return None
        return (*self._scope(job, inv), backend, facts.eth0_family, facts.eth0_namespace)

    # -- planning ------------------------------------------------------------------------------

    def plan(
        self,
        job: Job,
        free: Collection[NodeRecord] | Candidates,
        exclusions: Exclusions | None = None,
        mesh_id: str = "0" * 32,
    ) -> tuple[Plan | None, list[Shortfall]]:
        """The best plan over the free nodes, or the shortfall of every path tried."""
        candidates = free if isinstance(free, Candidates) else Candidates(free)
        exclusions = exclusions or Exclusions()
        paths, shortfalls = self.paths_for(job)
        for path in paths:
            plan, shortfall = self._plan_path(job, path, candidates, exclusions, mesh_id)
            if plan is not None:
                return plan, []
            shortfalls.append(shortfall)
        if not any(
            self.eligible(job, record) and record.inventory.node not in exclusions.nodes
            for shape in candidates.shapes(job)
            for record in candidates.by_shape[shape].values()
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

    def _records_for(
        self, job: Job, path: PathClass, candidates: Candidates
    ) -> Iterator[NodeRecord]:
        """The machines a plan on `path` looks at, in the view's order. Only those of the
        shapes asked for: a group (a private network) counts whole, models mixed, for its size."""
        shapes = candidates.shapes(job)
        model = job.spec.accelerators.model
        if path is PathClass.PRIVATE:
            for backend in dict.fromkeys(shape[0] for shape in shapes):
                for network, group in candidates.private.get(backend, {}).items():
                    if len(group) < job.spec.distributed.members:
                        continue
                    if model is None:
                        yield from group.values()
                    else:  # the group's machines of that model, in the group's order
                        yield from candidates.private_of_shape.get(
                            ((backend, model), network), {}
                        ).values()
        elif path is PathClass.DIRECT:
            for shape in shapes:
                yield from candidates.vms.get(shape, {}).values()
        else:
            for shape in shapes:
                yield from candidates.by_shape[shape].values()

    def _plan_path(
        self,
        job: Job,
        path: PathClass,
        candidates: Candidates,
        exclusions: Exclusions,
        mesh_id: str,
    ) -> tuple[Plan | None, Shortfall]:
        members = job.spec.distributed.members
        patterns = self.qualified_patterns(job, path)
        groups: dict[tuple[object, ...], list[NodeRecord]] = {}
        tried: dict[tuple[object, ...], int] = {}  # group -> size when last searched
        usable = capable = fitting = 0
        largest_buffer = 0
        needs = derive(path, members)  # C3: the plan's derived needs, from the one formula
        # G6: Relayed is for a member without a network device, or (G12) a failed direct path.
        needs_container = (
            path is PathClass.RELAYED
            and job.status.path_override is not PathClass.RELAYED
            and job.spec.qualify is None
        )
        budget = [SEARCH_BUDGET]
        # This loop visits thousands of machines per plan: what it asks of each is looked up
        # once here (the same tests as `eligible`, `_group_key` and `_missing_capabilities`).
        direct, private = path is PathClass.DIRECT, path is PathClass.PRIVATE
        excluded, excluded_addresses = exclusions.nodes, exclusions.addresses
        want = job.spec.accelerators
        want_count, want_backend, want_model = want.count, want.backend, want.model
        required = self.config.required_capabilities
        needed = [*required.all, *getattr(required, path.value)]
        buffer_needed = needs.tunnel_buffer_bytes
        facts = candidates.facts
        for record in self._records_for(job, path, candidates):
            inv = record.inventory
            if direct and inv.offering != "vm":
                continue
            have = inv.accelerators
            if (
                inv.node in excluded
                or have.count < want_count
                or (want_backend is not None and have.backend != want_backend)
                or (want_model is not None and have.model != want_model)
            ):
                continue
            key = self._group_key(job, inv, facts[inv.node], path)
            if key is None:
                continue
            usable += 1
            if needed and any(cap not in record.capabilities for cap in needed):
                continue
            capable += 1
            if record.tunnel_buffer_limit_bytes < buffer_needed:
                largest_buffer = max(largest_buffer, record.tunnel_buffer_limit_bytes)
                continue
            fitting += 1
            if not direct and (inv.private_address if private else inv.address) in (
                excluded_addresses
            ):
                continue
            group = groups.setdefault(key, [])
            group.append(record)
            # Search a group when it first could hold the gang, then each time it doubles.
            if len(group) >= members and len(group) >= 2 * tried.get(key, 0):
                tried[key] = len(group)
                found = self._search(path, group, members, patterns, budget, needs_container)
                if found is not None:
                    return self._build(path, found, mesh_id), _NO_SHORTFALL
        best = 0
        for key, group in groups.items():
            if len(group) >= members and tried.get(key) != len(group):
                found = self._search(path, group, members, patterns, budget, needs_container)
                if found is not None:
                    return self._build(path, found, mesh_id), _NO_SHORTFALL
            best = max(best, min(len(group), members - 1))
        if budget[0] <= 0:
            return None, Shortfall(
                path, ErrorCode.UNSATISFIABLE, f"{path.value}: search budget exhausted; try again"
            )
        if capable and not fitting:
            return None, Shortfall(
                path,
                ErrorCode.BOUNDS_EXCEEDED,
                f"{path.value}: each member needs {needs.tunnel_buffer_bytes >> 20} MiB of tunnel "
                f"buffer (its relay rate x RTT, C3); the machines' agents allow at most "
                f"{largest_buffer >> 20} MiB",
            )
        return None, self._explain(job, path, members, usable, capable, best, patterns)

    def _search(
        self,
        path: PathClass,
        group: list[NodeRecord],
        members: int,
        patterns: list[str],
        budget: list[int],
        needs_container: bool = True,
    ) -> list[NodeRecord] | None:
        """Choose `members` machines of one group: every pair qualified (G21), distinct advertised
        addresses (G7, C4), and on Relayed at least one container (G6). Machines of one type
        (provider, offering) are interchangeable for qualification, so the search runs over how
        many of each type, then matches machines to distinct addresses."""
        by_type: dict[tuple[str, str], list[NodeRecord]] = {}
        for record in group:
            by_type.setdefault((record.inventory.provider, record.inventory.offering), []).append(
                record
            )
        types = list(by_type)
        distinct = path is not PathClass.DIRECT

        def advertised(record: NodeRecord) -> str:
            inv = record.inventory
            return (inv.private_address or "") if path is PathClass.PRIVATE else inv.address

        capacity = [
            len({advertised(r) for r in by_type[t]}) if distinct else len(by_type[t]) for t in types
        ]
        remaining_capacity = [sum(capacity[i:]) for i in range(len(types))] + [0]
        qualified: dict[tuple[int, int], bool] = {}

        def ok(i: int, j: int) -> bool:
            if (i, j) not in qualified:
                qualified[(i, j)] = types_qualified(patterns, types[i], types[j])
            return qualified[(i, j)]

        counts = [0] * len(types)

        def assign() -> list[NodeRecord] | None:
            if needs_container and not any(
                counts[i] and types[i][1] == "container" for i in range(len(types))
            ):
                return None
            slots = [i for i in range(len(types)) for _ in range(counts[i])]
            if not distinct:
                taken: dict[int, int] = {}
                chosen = []
                for i in slots:
                    chosen.append(by_type[types[i]][taken.get(i, 0)])
                    taken[i] = taken.get(i, 0) + 1
                return chosen
            return _match_distinct(slots, [by_type[t] for t in types], advertised)

        def choose(i: int, left: int, picked: list[int]) -> list[NodeRecord] | None:
            budget[0] -= 1
            if budget[0] <= 0:
                return None
            if left == 0:
                return assign()
            if i == len(types) or remaining_capacity[i] < left:
                return None
            for count in range(min(capacity[i], left), -1, -1):
                if count and not ((count < 2 or ok(i, i)) and all(ok(i, j) for j in picked)):
                    continue
                counts[i] = count
                found = choose(i + 1, left - count, [*picked, i] if count else picked)
                if found is not None:
                    return found
            counts[i] = 0
            return None

        return choose(0, members, [])

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
                path,
                ErrorCode.NOT_QUALIFIED,
                f"{path.value}: no offering combination is qualified (none measured: "
                f"`nodus qualify --path {path.value}`; none in the placer config's "
                "`qualified` override)",
            )
        return Shortfall(
            path,
            ErrorCode.UNSATISFIABLE,
            f"{path.value}: needs {members} machines {where} with one accelerator backend, "
            f"distinct addresses and a qualified combination ({', '.join(patterns)}); "
            f"at most {best} found",
        )


_NO_SHORTFALL = Shortfall(PathClass.DIRECT, ErrorCode.INVALID, "")


def _match_distinct(
    slots: list[int],
    pools: list[list[NodeRecord]],
    advertised: Callable[[NodeRecord], str],
) -> list[NodeRecord] | None:
    """Give every slot (a type index) a machine of its type, all advertised addresses distinct:
    a bipartite matching of slots to addresses by augmenting paths (at most 8 slots)."""
    owner: dict[str, int] = {}  # address -> slot
    chosen: dict[int, NodeRecord] = {}

    def augment(slot: int, seen: set[str]) -> bool:
        for record in pools[slots[slot]]:
            address = advertised(record)
            if address in seen:
                continue
            seen.add(address)
            if address not in owner or augment(owner[address], seen):
                owner[address] = slot
                chosen[slot] = record
                return True
        return False

    for slot in range(len(slots)):
        if not augment(slot, set()):
            return None
    return [chosen[slot] for slot in range(len(slots))]

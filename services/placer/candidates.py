"""Machines indexed for planning (sans-I/O): by accelerator shape, VMs apart, private networks
by backend and by shape, with the address facts the planner asks of each, parsed once."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from libs.contracts.fleet import Inventory, NodeRecord
from libs.contracts.jobs import Job
from services.placer.addresses import address_problem, ip_family, is_loopback


@dataclass(frozen=True, slots=True)
class Facts:
    """What the planner needs of a record's addresses, parsed once when the record arrives."""

    eth0_usable: bool  # a unicast address (C4)
    eth0_namespace: str | None  # loopback: the namespace it is reachable in; None otherwise
    eth0_family: int
    private_usable: bool
    private_namespace: str | None
    private_family: int

    @staticmethod
    def of(inv: Inventory) -> Facts:
        def judge(address: str | None) -> tuple[bool, str | None, int]:
            if not address or address_problem(address) is not None:
                return False, None, 0
            if is_loopback(address):
                # Loopback reaches only inside one network namespace (C4).
                return bool(inv.network_namespace), inv.network_namespace, ip_family(address)
            return True, None, ip_family(address)

        eth0 = judge(inv.address)
        private = judge(inv.private_address) if inv.private_network else (False, None, 0)
        return Facts(*eth0, *private)


Shape = tuple[str, str]  # (backend, model)


class Candidates:
    """Machines indexed for planning: by accelerator shape, and private networks by backend."""

    def __init__(self, records: Iterable[NodeRecord] = ()) -> None:
        self.by_shape: dict[Shape, dict[str, NodeRecord]] = {}
        # Private networks by backend (a gang has one backend; models may mix when not asked).
        self.private: dict[str, dict[tuple[str, str, str], dict[str, NodeRecord]]] = {}
        self.facts: dict[str, Facts] = {}
        # Narrower views of the same machines, each in the same order as the one above it: a
        # plan that asks for a model, or a Direct plan (VMs only), walks only what it can use
        # instead of skipping thousands of machines one by one.
        self.vms: dict[Shape, dict[str, NodeRecord]] = {}
        self.private_of_shape: dict[tuple[Shape, tuple[str, str, str]], dict[str, NodeRecord]] = {}
        self._where: dict[str, tuple[Shape, tuple[str, str, str] | None]] = {}
        for record in records:
            self.add(record)

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, node: object) -> bool:
        return node in self._where

    def add(self, record: NodeRecord) -> None:
        inv = record.inventory
        self.remove(inv.node)
        shape = (inv.accelerators.backend, inv.accelerators.model)
        facts = Facts.of(inv)
        self.facts[inv.node] = facts
        self.by_shape.setdefault(shape, {})[inv.node] = record
        if inv.offering == "vm":
            self.vms.setdefault(shape, {})[inv.node] = record
        network = None
        if facts.private_usable and inv.private_network:
            network = (inv.provider, inv.region, inv.private_network)
            self.private.setdefault(shape[0], {}).setdefault(network, {})[inv.node] = record
            self.private_of_shape.setdefault((shape, network), {})[inv.node] = record
        self._where[inv.node] = (shape, network)

    def remove(self, node: str) -> None:
        where = self._where.pop(node, None)
        if where is None:
            return
        shape, network = where
        self.facts.pop(node, None)
        _forget(self.by_shape, shape, node)
        _forget(self.vms, shape, node)
        if network is not None:
            groups = self.private[shape[0]]
            groups[network].pop(node, None)
            if not groups[network]:
                del groups[network]
            if not groups:
                del self.private[shape[0]]
            _forget(self.private_of_shape, (shape, network), node)

    def shapes(self, job: Job) -> list[Shape]:
        want = job.spec.accelerators
        return [
            shape
            for shape in self.by_shape
            if (want.backend is None or shape[0] == want.backend)
            and (want.model is None or shape[1] == want.model)
        ]


def _forget(index: dict[Any, dict[str, NodeRecord]], where: Any, node: str) -> None:
    bucket = index.get(where)
    if bucket is not None:
        bucket.pop(node, None)
        if not bucket:
            del index[where]

"""One `MachineProvider` for the remediator that sends each action to the provider its node's
pool names in the config (`providers:`), the pool read from the node's inventory."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Protocol

from libs.bus import Bus
from libs.contracts import names
from libs.contracts.fleet import NodeRecord
from libs.contracts.providers import (
    DEFAULT_POOL,
    SUPPORTED,
    ExecRequest,
    PoolProvider,
    ProviderKind,
    RemediatorConfig,
)
from libs.contracts.remediation import Action, MachineState, Remediation
from services.remediator.provider import LabProviderFactory, MachineProvider, ProviderError
from services.remediator.providers import revalidation
from services.remediator.providers.execcmd import ExecProvider
from services.remediator.providers.inband import InbandProvider
from services.remediator.providers.ops import Ledger
from services.remediator.providers.redfish import RedfishProvider

log = logging.getLogger("nodus.remediator.providers")


class _Acts(Protocol):
    async def execute(self, node: str, action: Action, op_id: str) -> str | None: ...

    async def executed(self, node: str, op_id: str) -> bool: ...


def op_remediation(op_id: str) -> str:
    """The remediation an op id belongs to (`Repairs` makes it `<remediation id>.op`)."""
    return op_id.removesuffix(".op")


class PoolProviders:
    def __init__(
        self,
        bus: Bus,
        config: RemediatorConfig,
        state_dir: Path,
        replica: str,
        clock: Callable[[], datetime],
        revalidation_timeout: float = 30.0,
        lab: LabProviderFactory | None = None,
    ) -> None:
        self.bus = bus
        self.config = config
        self.revalidation_timeout = revalidation_timeout
        self.nodes = bus.bucket(names.BUCKET_NODES, NodeRecord)
        self.machines = bus.bucket(names.BUCKET_MACHINES, MachineState)
        self.remediations = bus.bucket(names.BUCKET_REMEDIATIONS, Remediation)
        self.ledger = Ledger(bus, replica, clock)
        # Built once at start: a missing credentials file stops the remediator with its reason.
        self.acts: dict[tuple[str, ProviderKind], _Acts] = {}
        self.local: MachineProvider | None = None
        self._lab = lab
        for pool, entry in config.providers.items():
            for kind in {entry.kind, *entry.actions.values()}:
                self.acts[(pool, kind)] = self._build(pool, entry, kind, state_dir, clock)
        if self.local is not None:
            log.warning(
                "the local provider rewrites lab files under %s: it repairs nothing real "
                "(nodus up and the lab only); give --config with a real provider per pool",
                state_dir,
            )

    def _build(
        self,
        pool: str,
        entry: PoolProvider,
        kind: ProviderKind,
        state_dir: Path,
        clock: Callable[[], datetime],
    ) -> _Acts:
        if kind is ProviderKind.LOCAL:
            if self._lab is None:
                raise ValueError(
                    f"pool {pool!r}: the local provider is the lab's (nodus up); this "
                    "remediator was started without it: give the pool a real provider"
                )
            if self.local is None:
                self.local = self._lab(self.bus, state_dir, clock)
            return self.local
        if kind is ProviderKind.INBAND:
            return InbandProvider(self.bus, self.ledger, entry.inband)
        if kind is ProviderKind.REDFISH:
            assert entry.redfish is not None  # config.check
            return RedfishProvider(entry.redfish, self.ledger)
        assert entry.exec is not None  # config.check
        return ExecProvider(self.bus, entry.exec, self.ledger, self._describe)

    async def pool_of(self, node: str) -> tuple[str, PoolProvider]:
        record = await self.nodes.get(node)
        pool = record.value.inventory.pool if record else ""
        entry = self.config.providers.get(pool)
        if entry is not None:
            return pool, entry
        default = self.config.providers.get(DEFAULT_POOL)
        if default is None:
            raise ProviderError(
                f"no provider for pool {pool or '(unknown)'} of {node} in the remediator's "
                f"config, and no default ({DEFAULT_POOL!r})"
            )
        return DEFAULT_POOL, default

    async def _provider(self, node: str, action: Action) -> _Acts:
        pool, entry = await self.pool_of(node)
        kind = entry.kind_for(action)
        if action not in SUPPORTED[kind]:
            raise ProviderError(
                f"pool {pool}: {kind.value} cannot carry out {action.value}; route it to "
                "another provider (providers.<pool>.actions)"
            )
        return self.acts[(pool, kind)]

    async def execute(self, node: str, action: Action, op_id: str) -> str | None:
        return await (await self._provider(node, action)).execute(node, action, op_id)

    async def executed(self, node: str, op_id: str) -> bool:
        if await self.ledger.done(op_id):
            return True
        return self.local is not None and await self.local.executed(node, op_id)

    async def host(self, node: str) -> tuple[str, bool]:
        found = await self.machines.get(node)
        if found is None:
            return f"host-{node}", False
        return found.value.host_id, found.value.retired

    async def has_capacity(self, node: str, action: Action) -> bool:
        _, entry = await self.pool_of(node)
        if entry.kind_for(action) is ProviderKind.LOCAL and self.local is not None:
            return await self.local.has_capacity(node, action)
        return True

    async def diagnose(self, node: str) -> list[str]:
        """On the machine itself (R15, R18); the lab's machines are read from their files."""
        _, entry = await self.pool_of(node)
        if entry.kind is ProviderKind.LOCAL and self.local is not None:
            return await self.local.diagnose(node)
        return await revalidation.on_machine(self.bus, node, timeout=self.revalidation_timeout)

    async def _describe(self, node: str, action: Action, op_id: str) -> ExecRequest:
        rid = op_remediation(op_id)
        found = await self.remediations.get(rid)
        rem = found.value if found else None
        return ExecRequest(
            node=node,
            action=action,
            op_id=op_id,
            idempotency_key=op_id,
            pool=rem.pool if rem else "",
            cluster=rem.cluster if rem else "",
            remediation_id=rid if rem else "",
            requester=f"{rem.requester.kind}:{rem.requester.name}" if rem else "",
            reason=rem.rule if rem else "",
            evidence=[
                f"{e.kind.value} from {e.source} at {e.where}"
                + (f" (Xid {e.xid})" if e.xid is not None else "")
                + (f": {e.lines[0]}" if e.lines else "")
                for e in (rem.evidence if rem else [])
            ],
        )

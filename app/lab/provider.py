"""The lab's machine provider (`local` in the remediator's config): it acts on the simulated
machines of `nodus up` (R9, R12, R15):

- Reboot / PowerCycle: the machine's volatile detector inputs start over (a new boot) and its
  agent process starts again with a new boot id (`nodus.node.<node>.req.reboot`): its ranks
  and tunnels are gone, its `scratch/` (NODUS_SCRATCH_DIR) stays;
- Reprovision: a clean image: `STATE_DIR/machines/NAME/` starts over, `scratch/` included,
  keeping only the machine's identity (its bus seed) and rank logs; the agent starts again;
- Migrate: the machine moves to a new host id; the old host's files go to
  `STATE_DIR/hosts/<host>/` and that host goes straight to revalidation; the machine starts
  fresh on the new one (identity and logs go with it);
- Delete: the machine is retired and its host goes to revalidation.

The machine is back when its agent registers with a new boot id (and, migrated, on the new
host); its revalidation runs every detector over its files and asks its agent, which must answer.
A host left behind is revalidated on its files: a healthy host rejoins the pool of spare hosts,
a failed one stays out (RMA)."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import msgspec

from app.lab import faults
from libs.bus import Bus
from libs.contracts import names
from libs.contracts.base import now as utc_now
from libs.contracts.errors import NodusError
from libs.contracts.providers import HealthCheckReply, HealthCheckRequest
from libs.contracts.remediation import (
    Action,
    HostRecord,
    MachineState,
    RebootReply,
    RebootRequest,
)
from services.monitor.detectors.machine import MachinePaths, diagnose

log = logging.getLogger("nodus.remediator.provider")


def host_dir(state_dir: Path, host_id: str) -> Path:
    return state_dir / "hosts" / host_id


class LocalProvider:
    def __init__(
        self,
        bus: Bus,
        state_dir: Path,
        clock: Callable[[], datetime] = utc_now,
        spare_hosts: int | None = None,
        agent_timeout: float = 5.0,
    ) -> None:
        self.bus = bus
        self.state_dir = state_dir
        self.clock = clock
        self.spare_hosts = spare_hosts  # None: as many as needed
        self.agent_timeout = agent_timeout
        self.machines = bus.bucket(names.BUCKET_MACHINES, MachineState)
        self.hosts = bus.bucket(names.BUCKET_HOSTS, HostRecord)

    def machine_dir(self, node: str) -> Path:
        return self.state_dir / "machines" / node

    async def _state(self, node: str) -> MachineState:
        found = await self.machines.get(node)
        return found.value if found else MachineState(node=node, host_id=f"host-{node}")

    async def host(self, node: str) -> tuple[str, bool]:
        state = await self._state(node)
        return state.host_id, state.retired

    async def executed(self, node: str, op_id: str) -> bool:
        return (await self._state(node)).last_op_id == op_id

    async def has_capacity(self, node: str, action: Action) -> bool:
        if action is not Action.MIGRATE or self.spare_hosts is None:
            return True
        used = [
            s
            for s in (await self.machines.snapshot()).values()
            if s.value.host_id != f"host-{s.key}"
        ]
        return len(used) < self.spare_hosts

    async def execute(self, node: str, action: Action, op_id: str) -> str | None:
        state = await self._state(node)
        if state.last_op_id == op_id:
            return None
        directory = self.machine_dir(node)
        host_id = state.host_id
        retired = state.retired
        if action in (Action.REBOOT, Action.POWER_CYCLE):
            await asyncio.to_thread(faults.reboot, directory)
            await self._boot(node, op_id, action is Action.POWER_CYCLE)
        elif action is Action.REPROVISION:
            await asyncio.to_thread(faults.reprovision, directory)
            await self._boot(node, op_id, False)
        elif action is Action.MIGRATE:
            host_id = f"host-{node}-{hashlib.sha256(op_id.encode()).hexdigest()[:6]}"
            await self._leave_host(node, state.host_id, directory)
            await self._boot(node, op_id, False)
        elif action is Action.DELETE:
            await self._leave_host(node, state.host_id, directory)
            retired = True
        t = self.clock()

        def done(current: MachineState | None) -> MachineState | None:
            base = current or state
            if base.last_op_id == op_id:
                return None
            return msgspec.structs.replace(
                base,
                host_id=host_id,
                retired=retired,
                last_op_id=op_id,
                last_op_action=action,
                last_op_time=t,
            )

        await self.machines.mutate(node, done)
        log.info("%s on %s done (op %s, host %s)", action.value, node, op_id, host_id)
        return None

    async def _boot(self, node: str, op_id: str, power_cycle: bool) -> None:
        await self.bus.request(
            names.node_request(node, names.AgentVerb.REBOOT),
            RebootRequest(op_id=op_id, power_cycle=power_cycle),
            RebootReply,
            timeout=self.agent_timeout,
        )

    async def _leave_host(self, node: str, old_host: str, directory: Path) -> None:
        """The machine leaves `old_host`, which goes straight to revalidation (R15)."""
        target = host_dir(self.state_dir, old_host)
        if not target.exists():  # a retry after a restart must not move the new files over it
            await asyncio.to_thread(faults.move_to_host, directory, target)
        await self.revalidate_host(old_host, node)

    async def revalidate_host(self, host_id: str, node: str) -> HostRecord:
        t = self.clock()
        await self.hosts.put(
            host_id,
            HostRecord(
                host_id=host_id,
                node=node,
                state="Revalidating",
                reason=f"left by {node}; running diagnostics",
                time=t,
            ),
        )
        paths = MachinePaths.under(host_dir(self.state_dir, host_id))
        failures = await asyncio.to_thread(diagnose, node, paths, t)
        record = HostRecord(
            host_id=host_id,
            node=node,
            state="Failed" if failures else "Healthy",
            reason=(
                "diagnostics failed: the host stays out of the pool (RMA)"
                if failures
                else "diagnostics passed: the host rejoins the pool of spare hosts"
            ),
            time=self.clock(),
            findings=[f"{f.kind.value} {f.subject}: {f.detail}" for f in failures],
        )
        await self.hosts.put(host_id, record)
        return record

    async def diagnose(self, node: str) -> list[str]:
        """Every detector over the machine's files, and its agent, which must answer from the
        boot the repair caused."""
        paths = MachinePaths.under(self.machine_dir(node))
        failures = await asyncio.to_thread(diagnose, node, paths, self.clock())
        found = [f"{f.kind.value} {f.subject}: {f.detail}" for f in failures]
        try:  # the agent's own checks, on the machine (the lab's agent shares this host)
            reply = await self.bus.request(
                names.node_request(node, names.AgentVerb.HEALTH),
                HealthCheckRequest(),
                HealthCheckReply,
                timeout=self.agent_timeout,
            )
        except NodusError as error:
            found.append(f"agent: {node}'s agent does not answer after the repair: {error}")
        else:
            found += [f for f in reply.failures if f not in found]
        return found

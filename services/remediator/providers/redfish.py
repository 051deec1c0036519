"""The BMC over Redfish (sushy, the OpenStack Redfish library): power cycle for faults that
need GPU power loss (Xid 79, R12), restart, and a one-time network boot for a reprovision.

sushy is synchronous (requests); each call runs in a thread with the configured timeout. Each
step done is recorded on the op's ledger record, so a retry after a replica died (the system
already Off, say) continues where it stopped instead of starting the cycle again."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any, TypeVar

import sushy
from sushy import exceptions as sushy_errors

from libs.contracts.providers import Bmc, Credentials, ProviderKind, ProviderOp, RedfishSettings
from libs.contracts.remediation import Action
from services.remediator.provider import ProviderError
from services.remediator.providers.config import load_credentials
from services.remediator.providers.ops import Ledger

log = logging.getLogger("nodus.remediator.redfish")

T = TypeVar("T")
POLL_SECONDS = 1.0  # how often a power cycle asks for the power state


class RedfishProvider:
    def __init__(
        self,
        settings: RedfishSettings,
        ledger: Ledger,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.settings = settings
        self.ledger = ledger
        self.sleep = sleep
        # Read at start, so a missing or malformed file stops the remediator with its reason.
        self.credentials: Credentials = load_credentials(settings.credentials_file)

    def bmc(self, node: str) -> Bmc:
        entry = self.settings.bmcs.get(node)
        if isinstance(entry, Bmc):
            return entry
        if isinstance(entry, str):
            return Bmc(address=entry)
        if self.settings.address_template:
            return Bmc(address=self.settings.address_template.format(node=node))
        raise ProviderError(f"no BMC for {node}: add it to redfish.bmcs")

    async def executed(self, node: str, op_id: str) -> bool:
        return await self.ledger.done(op_id)

    async def execute(self, node: str, action: Action, op_id: str) -> str | None:
        if action not in (Action.REBOOT, Action.POWER_CYCLE, Action.REPROVISION):
            raise ProviderError(f"Redfish does not carry out {action.value}")
        bmc = self.bmc(node)
        op, mine = await self.ledger.claim(op_id, node, action, ProviderKind.REDFISH)
        if op.state == "Done":
            return None
        if op.state == "Failed":
            raise ProviderError(op.answer)
        stale = self.ledger.clock() - op.claim_time > timedelta(
            seconds=2 * self.settings.power_timeout_seconds + 60
        )
        if not mine and op.replica != self.ledger.replica and not stale:
            raise ProviderError(
                f"replica {op.replica} is carrying out {action.value} on {node}'s BMC",
                permanent=False,
            )
        session = _Session(bmc, self.settings, self.credentials)
        try:
            answer = await self._run(session, action, op)
        except ProviderError as error:
            await self.ledger.finish(op_id, False, error.reason)
            raise
        await self.ledger.finish(op_id, True, answer)
        log.info("%s on %s through %s: %s", action.value, node, bmc.address, answer)
        return answer

    async def _run(self, session: _Session, action: Action, op: ProviderOp) -> str:
        steps = list(op.steps)

        async def step(name: str) -> None:
            steps.append(name)
            await self.ledger.update(op.op_id, steps=list(steps))

        system = await session.system()
        said: list[str] = [f"BMC {session.bmc.address}"]
        if action is Action.POWER_CYCLE:
            allowed = await session.call("its reset types", system.get_allowed_reset_system_values)
            if sushy.ResetType.POWER_CYCLE in allowed and not steps:
                # The BMC cycles the power itself (off, then on after its own delay).
                await session.call("PowerCycle", system.reset_system, sushy.ResetType.POWER_CYCLE)
                await step("cycle")
                return f"{said[0]}: PowerCycle"
            if "off" not in steps:
                waited = await self._power(
                    session, system, sushy.ResetType.FORCE_OFF, sushy.PowerState.OFF
                )
                said.append(f"ForceOff, Off after {waited:.1f} s")
                await step("off")
                # The GPUs must lose power (Xid 79): hold it off before powering on.
                await self.sleep(self.settings.off_seconds)
                said.append(f"held off {self.settings.off_seconds:g} s")
            waited = await self._power(session, system, sushy.ResetType.ON, sushy.PowerState.ON)
            said.append(f"On, On after {waited:.1f} s")
            await step("on")
            return ", ".join(said)
        if action is Action.REPROVISION and "pxe" not in steps:
            await session.call(
                "a one-time network boot (boot source override Pxe, Once)",
                system.set_system_boot_options,
                sushy.BootSource.PXE,
                enabled=sushy.BootSourceOverrideEnabled.ONCE,
            )
            said.append("boot source override Pxe once")
            await step("pxe")
        await session.call("its power state", system.refresh)
        if system.power_state == sushy.PowerState.OFF:
            await session.call("On", system.reset_system, sushy.ResetType.ON)
            said.append("On (it was off)")
        else:
            allowed = await session.call("its reset types", system.get_allowed_reset_system_values)
            reset = (
                sushy.ResetType.GRACEFUL_RESTART
                if action is Action.REBOOT and sushy.ResetType.GRACEFUL_RESTART in allowed
                else sushy.ResetType.FORCE_RESTART
            )
            await session.call(reset.value, system.reset_system, reset)
            said.append(reset.value)
        await step("restart")
        return ", ".join(said)

    async def _power(self, session: _Session, system: Any, reset: Any, want: Any) -> float:
        """Ask for `reset` unless the system is already `want`, then wait until it says so."""
        started = time.monotonic()
        await session.call("its power state", system.refresh)
        if system.power_state != want:
            await session.call(reset.value, system.reset_system, reset)
        deadline = started + self.settings.power_timeout_seconds
        while True:
            await session.call("its power state", system.refresh)
            if system.power_state == want:
                return time.monotonic() - started
            state = system.power_state.value if system.power_state else "unknown"
            if time.monotonic() > deadline:
                raise ProviderError(
                    f"BMC {session.bmc.address}: the system did not report {want.value} within "
                    f"{self.settings.power_timeout_seconds:g} s after {reset.value} (still {state})"
                )
            await self.sleep(POLL_SECONDS)


class _Session:
    """One conversation with one BMC; every failure is a ProviderError with its reason."""

    def __init__(self, bmc: Bmc, settings: RedfishSettings, credentials: Credentials) -> None:
        self.bmc = bmc
        self.settings = settings
        self.credentials = credentials
        self._conn: sushy.Sushy | None = None

    async def call(self, what: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except sushy_errors.HTTPError as error:
            raise ProviderError(
                f"BMC {self.bmc.address} refused {what}: HTTP {error.status_code}: "
                f"{error.detail or error.code}"
            ) from None
        except sushy_errors.ConnectionError as error:
            raise ProviderError(
                f"BMC {self.bmc.address} did not answer {what} (timeout "
                f"{self.settings.timeout_seconds:g} s): {_cause(error)}"
            ) from None
        except sushy_errors.SushyError as error:
            raise ProviderError(f"BMC {self.bmc.address}: {what}: {error}") from None

    async def system(self) -> Any:
        conn = await self.call("a session", self._connect)
        if self.bmc.system:
            return await self.call(f"system {self.bmc.system}", conn.get_system, self.bmc.system)
        collection = await self.call("its systems", conn.get_system_collection)
        members = list(collection.members_identities)
        if len(members) != 1:
            raise ProviderError(
                f"BMC {self.bmc.address} manages {len(members)} systems: name the node's "
                "(system: /redfish/v1/Systems/ID) in redfish.bmcs"
            )
        return await self.call(f"system {members[0]}", conn.get_system, members[0])

    def _connect(self) -> sushy.Sushy:
        address = self.bmc.address.rstrip("/")
        address = address.removesuffix("/redfish/v1")
        verify = self.settings.verify_tls
        self._conn = sushy.Sushy(
            address,
            username=self.credentials.username,
            password=self.credentials.password,
            verify=verify,
            read_timeout=self.settings.timeout_seconds,
            connect_timeout=self.settings.timeout_seconds,
            # One attempt per call: the step's own retry is the remediation's next tick.
            server_side_retries=1,
            server_side_retries_delay=1,
        )
        return self._conn


def _cause(error: Exception) -> str:
    detail = getattr(error, "detail", None) or str(error)
    return str(detail)[:300]

"""In-band: the machine's agent drains its ranks and reboots its own host through systemd.
Only Reboot goes this way: the lightest action, for a machine whose OS and agent still run."""

from __future__ import annotations

from libs.bus import Bus
from libs.contracts import names
from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.providers import (
    HostRebootReply,
    HostRebootRequest,
    InbandSettings,
    ProviderKind,
)
from libs.contracts.remediation import Action
from services.remediator.provider import ProviderError
from services.remediator.providers.ops import Ledger

# The agent is not there (yet, or booting): try again on the next tick, up to the timeout.
TRANSIENT = (ErrorCode.NO_RESPONDERS, ErrorCode.TIMEOUT)


class InbandProvider:
    def __init__(self, bus: Bus, ledger: Ledger, settings: InbandSettings | None = None) -> None:
        self.bus = bus
        self.ledger = ledger
        self.settings = settings or InbandSettings()

    async def executed(self, node: str, op_id: str) -> bool:
        return await self.ledger.done(op_id)

    async def execute(self, node: str, action: Action, op_id: str) -> str | None:
        if action is not Action.REBOOT:
            raise ProviderError(f"in-band does Reboot only, not {action.value}")
        if await self.ledger.done(op_id):
            return None
        try:
            reply = await self.bus.request(
                names.node_request(node, names.AgentVerb.HOST_REBOOT),
                HostRebootRequest(op_id=op_id),
                HostRebootReply,
                timeout=self.settings.timeout_seconds,
            )
        except NodusError as error:
            raise ProviderError(
                f"{node}'s agent: {error.message}", permanent=error.code not in TRANSIENT
            ) from None
        answer = (
            f"{node}'s agent rebooted its host earlier for this op"
            if reply.already
            else f"{node}'s agent drained {reply.drained} ranks and rebooted its host "
            f"(boot {reply.boot_id})"
        )
        await self.ledger.claim(op_id, node, action, ProviderKind.INBAND)
        await self.ledger.finish(op_id, True, answer)
        return answer

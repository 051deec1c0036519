"""Machine providers: how a repair is carried out (R9, R12, R15). `MachineProvider` is the
interface a cloud's or a datacenter's integration implements (see `providers/`); the lab's
stand-in, which rewrites simulated machines' files, is `app.lab.provider.LocalProvider`."""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Protocol

from libs.bus import Bus
from libs.contracts.remediation import Action

log = logging.getLogger("nodus.remediator.provider")


class ProviderError(Exception):
    """An action the provider could not carry out, with its reason as the operator reads it.
    `permanent`: retrying cannot help (a BMC that refuses, an operator's command that failed,
    an action the pool's provider does not do): the step fails at once. Otherwise (an agent
    that does not answer yet) the repair tries again until its action timeout."""

    def __init__(self, reason: str, permanent: bool = True) -> None:
        super().__init__(reason)
        self.reason = reason
        self.permanent = permanent


class MachineProvider(Protocol):
    async def execute(self, node: str, action: Action, op_id: str) -> str | None:
        """Carry out `action` on `node` once per `op_id`; calling again with the same op id
        after it completed does nothing. Returns the provider's answer, for the record;
        raises ProviderError (or anything else: retried) when it could not."""

    async def executed(self, node: str, op_id: str) -> bool:
        """Did `op_id` complete on `node`?"""

    async def host(self, node: str) -> tuple[str, bool]:
        """The node's host id, and whether the node is retired."""

    async def diagnose(self, node: str) -> list[str]:
        """Diagnostics before the node rejoins (R15): the failures; empty when healthy."""

    async def has_capacity(self, node: str, action: Action) -> bool:
        """Can `action` be carried out now (a spare host for a migrate)?"""


# How the lab's provider is made (bus, state directory, clock): `nodus remediator` hands it
# to the remediator; a remediator without it has no `local` provider to give a pool.
LabProviderFactory = Callable[[Bus, Path, Callable[[], datetime]], MachineProvider]

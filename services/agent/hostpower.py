"""In-band reboot (R9, R18): the agent drains its ranks, then reboots its own host through
systemd (`systemctl reboot`). Off unless the agent is started with --host-reboot: a machine's
operator chooses to let the control plane reboot it.

The op id is remembered in the agent's state directory before the command runs, so a request
repeated after the boot (its answer was lost with the old boot) does not reboot the host again;
the remediator's boot-id check (R12) holds even where that memory is gone."""

from __future__ import annotations

import asyncio
import logging
import shlex
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.providers import HostRebootReply, HostRebootRequest
from libs.runtime.processes import reaped
from services.agent.ranks import RankRunner

log = logging.getLogger("nodus.agent.hostpower")

DEFAULT_COMMAND = ("systemctl", "reboot")
COMMAND_SECONDS = 30.0  # systemctl returns once the reboot job is queued


class HostPower:
    def __init__(
        self,
        node: str,
        enabled: bool,
        drain: Callable[[float], Awaitable[int]],
        command: Sequence[str] = DEFAULT_COMMAND,
        state_file: Path | None = None,
    ) -> None:
        self.node = node
        self.enabled = enabled
        self.drain = drain
        self.command = list(command)
        self.state_file = state_file
        self._last_op = ""

    def _remembered(self) -> str:
        if self.state_file is None:
            return self._last_op
        try:
            return self.state_file.read_text().strip()
        except OSError:
            return ""

    def _remember(self, op_id: str) -> None:
        self._last_op = op_id
        if self.state_file is not None:
            self.state_file.parent.mkdir(parents=True, exist_ok=True)
            self.state_file.write_text(op_id + "\n")

    async def reboot(self, request: HostRebootRequest, boot_id: str) -> HostRebootReply:
        if not self.enabled:
            raise NodusError(
                ErrorCode.MISSING_CAPABILITY,
                f"in-band reboot is off on {self.node}'s agent (start it with --host-reboot)",
            )
        if request.op_id and self._remembered() == request.op_id:
            return HostRebootReply(node=self.node, boot_id=boot_id, already=True)
        drained = await self.drain(request.drain_seconds)
        log.warning(
            "%s: %d ranks drained; rebooting this host for op %s: %s",
            self.node,
            drained,
            request.op_id,
            shlex.join(self.command),
        )
        self._remember(request.op_id)
        code, err = await _run(self.command)
        if code != 0:
            self._remember("")  # it did not reboot: a retry may
            raise NodusError(
                ErrorCode.INTERNAL,
                f"{shlex.join(self.command)} exited {code}: {err.strip()[-300:] or 'no stderr'}",
            )
        return HostRebootReply(node=self.node, boot_id=boot_id, drained=drained)


async def _run(command: Sequence[str]) -> tuple[int, str]:
    try:
        process = await asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
    except OSError as error:
        return 127, f"{command[0]}: {error.strerror}"
    try:
        async with reaped(process):
            _, err = await asyncio.wait_for(process.communicate(), COMMAND_SECONDS)
    except TimeoutError:
        return -1, f"did not return within {COMMAND_SECONDS:g} s"
    return process.returncode or 0, err.decode(errors="replace")


async def drain_ranks(runner: RankRunner, grace: float) -> int:
    """Stop every rank on this machine (SIGTERM, SIGKILL after `grace`); how many."""
    stopped = 0
    for gang in sorted({entry.status.gang for entry in list(runner.running.values())}):
        stopped += await runner.stop(gang, grace=grace)
    return stopped

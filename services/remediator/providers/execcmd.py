"""The operator's own command per action (reprovision, migrate, the hand-off of a delete to a
person): a JSON `ExecRequest` on its stdin, the idempotency key in its environment, a timeout,
and its answer (exit code, stdout, the tail of stderr) recorded on the op's ledger record.

Once per idempotency key, whatever the replicas do (R14): the op's ledger record is created
with compare-and-set before the command starts; a replica that loses that race reads the
answer recorded there (waiting while the winner runs it). A claim whose answer never came (its
replica died mid-run) is failed for a person to check, never run again."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import signal
from collections.abc import Awaitable, Callable
from datetime import timedelta

import msgspec

from libs.bus import Bus
from libs.contracts import names
from libs.contracts.base import encode
from libs.contracts.providers import (
    ExecAnswer,
    ExecRequest,
    ExecSettings,
    ProviderKind,
    ProviderOp,
)
from libs.contracts.remediation import Action, MachineState
from libs.runtime.processes import reaped
from services.remediator.provider import ProviderError
from services.remediator.providers.ops import MAX_TEXT, Ledger, tail

log = logging.getLogger("nodus.remediator.exec")

# (node, action, op id) -> what the request says beyond them (pool, evidence, ...).
Describe = Callable[[str, Action, str], Awaitable[ExecRequest]]


class ExecProvider:
    def __init__(
        self, bus: Bus, settings: ExecSettings, ledger: Ledger, describe: Describe
    ) -> None:
        self.settings = settings
        self.ledger = ledger
        self.describe = describe
        self.machines = bus.bucket(names.BUCKET_MACHINES, MachineState)

    async def executed(self, node: str, op_id: str) -> bool:
        return await self.ledger.done(op_id)

    async def execute(self, node: str, action: Action, op_id: str) -> str | None:
        argv = self.settings.commands.get(action)
        if argv is None:
            raise ProviderError(f"exec has no command for {action.value} (exec.commands)")
        op, mine = await self.ledger.claim(op_id, node, action, ProviderKind.EXEC)
        if not mine:
            return self._recorded(op)
        request = await self.describe(node, action, op_id)
        try:
            code, out, err = await self._run(argv, request)
        except ProviderError as error:
            await self.ledger.finish(op_id, False, error.reason)
            raise
        except BaseException:  # cancelled mid-run (the replica stops): a person checks
            with contextlib.suppress(Exception):
                await asyncio.shield(
                    self.ledger.finish(op_id, False, f"{argv[0]} was interrupted (replica stopped)")
                )
            raise
        answer = _answer(out)
        first_line = out.strip().splitlines()[0][:300] if out.strip() else ""
        text = answer.message or first_line
        recorded = dict(exit_code=code, stdout=tail(out), stderr_tail=tail(err, 2048))
        if code != 0:
            last = err.strip().splitlines()[-1][:300] if err.strip() else "no stderr"
            reason = f"{argv[0]} exited {code} for {action.value} of {node}: {last}"
            await self.ledger.finish(op_id, False, reason, **recorded)
            raise ProviderError(reason)
        host = answer.host or (
            f"host-{node}-{hashlib.sha256(op_id.encode()).hexdigest()[:6]}"
            if action is Action.MIGRATE
            else ""
        )
        retired = answer.retired or action is Action.DELETE
        said = f"{argv[0]} exited 0" + (f": {text}" if text else "")
        await self.ledger.finish(op_id, True, said, host_id=host, retired=retired, **recorded)
        await self._machine_moved(node, action, op_id, host, retired)
        log.info("%s of %s by %s (op %s): %s", action.value, node, argv[0], op_id, said)
        return said

    def _recorded(self, op: ProviderOp) -> str | None:
        """Another replica's claim (or this op's earlier run): its answer, never a second run."""
        if op.state == "Done":
            return op.answer
        if op.state == "Failed":
            raise ProviderError(op.answer)
        limit = timedelta(seconds=self.settings.timeout_seconds + self.settings.claim_grace_seconds)
        if self.ledger.clock() - op.claim_time > limit:
            raise ProviderError(
                f"replica {op.replica} claimed {op.action.value} of {op.node} at "
                f"{op.claim_time:%Y-%m-%dT%H:%M:%S}Z and never recorded the command's answer: "
                "it may have run; a person checks before it is requested again"
            )
        raise ProviderError(
            f"replica {op.replica} runs the operator's {op.action.value} command; waiting for "
            "its answer",
            permanent=False,
        )

    async def _run(self, argv: list[str], request: ExecRequest) -> tuple[int, str, str]:
        env = {
            **os.environ,
            "NODUS_IDEMPOTENCY_KEY": request.idempotency_key,
            "NODUS_OP_ID": request.op_id,
            "NODUS_NODE": request.node,
            "NODUS_ACTION": request.action.value,
        }
        try:
            process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=env,
                start_new_session=True,  # its own process group: a timeout ends all of it
            )
        except OSError as error:
            raise ProviderError(f"{argv[0]} could not be started: {error.strerror}") from None
        try:
            async with reaped(process, lambda: _kill(process.pid)):
                out, err = await asyncio.wait_for(
                    process.communicate(encode(request) + b"\n"), self.settings.timeout_seconds
                )
        except TimeoutError:
            raise ProviderError(
                f"{argv[0]} did not finish within {self.settings.timeout_seconds:g} s (killed)"
            ) from None
        assert process.returncode is not None
        return (
            process.returncode,
            out[: MAX_TEXT * 4].decode(errors="replace"),
            err[-MAX_TEXT:].decode(errors="replace"),
        )

    async def _machine_moved(
        self, node: str, action: Action, op_id: str, host: str, retired: bool
    ) -> None:
        """A migrate puts the machine on a new host; a delete retires it (what `came_back`
        looks for)."""
        if action not in (Action.MIGRATE, Action.DELETE):
            return

        def change(current: MachineState | None) -> MachineState | None:
            base = current or MachineState(node=node, host_id=f"host-{node}")
            if base.last_op_id == op_id:
                return None
            return msgspec.structs.replace(
                base,
                host_id=host or base.host_id,
                retired=retired,
                last_op_id=op_id,
                last_op_action=action,
                last_op_time=self.ledger.clock(),
            )

        await self.machines.mutate(node, change)


def _answer(out: str) -> ExecAnswer:
    try:
        data = json.loads(out)
    except ValueError:
        return ExecAnswer()
    try:
        return msgspec.convert(data, ExecAnswer) if isinstance(data, dict) else ExecAnswer()
    except msgspec.ValidationError:
        return ExecAnswer()


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)

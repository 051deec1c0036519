"""In-band reboot on the agent (R18): off unless enabled; drains the ranks, then runs the
reboot command (here a script that records it ran, after the drain); once per op id."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.providers import HostRebootRequest
from services.agent.hostpower import HostPower


def recorder(path: Path) -> list[str]:
    """A reboot command that appends its time to `path`."""
    code = f"import time; open({str(path)!r}, 'a').write(f'{{time.time()}}\\n')"
    return [sys.executable, "-c", code]


async def test_it_drains_then_reboots_once_per_op(tmp_path: Path) -> None:
    drained_at: list[float] = []

    async def drain(grace: float) -> int:
        assert grace == 3.0
        drained_at.append(time.time())
        return 2

    rebooted = tmp_path / "rebooted"
    power = HostPower("gpu-a", True, drain, recorder(rebooted), tmp_path / "op")
    reply = await power.reboot(HostRebootRequest(op_id="r1.op", drain_seconds=3.0), "boot-1")
    assert (reply.drained, reply.already, reply.boot_id) == (2, False, "boot-1")
    [ran] = [float(line) for line in rebooted.read_text().splitlines()]
    assert drained_at and drained_at[0] <= ran  # the command ran after the drain
    # the same op again (its answer was lost with the boot): remembered on disk, not again
    again = HostPower("gpu-a", True, drain, recorder(rebooted), tmp_path / "op")
    assert (await again.reboot(HostRebootRequest(op_id="r1.op"), "boot-2")).already
    assert len(rebooted.read_text().splitlines()) == 1


async def test_it_is_off_by_default_and_says_how_to_turn_it_on(tmp_path: Path) -> None:
    async def drain(grace: float) -> int:
        raise AssertionError("nothing is drained when the reboot is refused")

    power = HostPower("gpu-a", False, drain, recorder(tmp_path / "rebooted"))
    with pytest.raises(NodusError) as refused:
        await power.reboot(HostRebootRequest(op_id="r1.op"), "boot-1")
    assert refused.value.code is ErrorCode.MISSING_CAPABILITY
    assert "--host-reboot" in refused.value.message
    assert not (tmp_path / "rebooted").exists()


async def test_a_failed_command_is_a_readable_error_and_can_be_retried(tmp_path: Path) -> None:
    async def drain(grace: float) -> int:
        return 0

    failing = [sys.executable, "-c", "import sys; sys.exit('Access denied by polkit')"]
    power = HostPower("gpu-a", True, drain, failing, tmp_path / "op")
    with pytest.raises(NodusError, match="exited 1: Access denied by polkit"):
        await power.reboot(HostRebootRequest(op_id="r1.op"), "boot-1")
    power.command = recorder(tmp_path / "rebooted")
    assert not (await power.reboot(HostRebootRequest(op_id="r1.op"), "boot-1")).already

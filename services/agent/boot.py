"""Which boot of the machine this is (O4). The machine is the truth, not the agent process: an
agent that stops and starts again on the same boot (an upgrade, a crash) is the same boot, and
re-adopts what it left running; a reboot is a new boot, and the placer ends its epochs at once.

On a real machine the boot id is the kernel's (`/proc/sys/kernel/random/boot_id`, a new random
UUID at every boot). A machine of the lab (several on one kernel) keeps a boot id of its own in
its state directory (`boot_id`), which the lab's reboot (`app.lab.faults.reboot`)
writes anew."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

KERNEL_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
LAB_BOOT_ID = "boot_id"  # in a lab machine's state directory


class BootIdentity:
    """A machine's boot id, and whether the boot is simulated (the lab). A simulated reboot
    leaves the old boot's processes alive on the shared kernel: the agent of the new boot must
    kill them itself; a real reboot already did."""

    def __init__(self, boot_id: str, simulated: bool) -> None:
        self.boot_id = boot_id
        self.simulated = simulated

    def __repr__(self) -> str:
        return f"BootIdentity({self.boot_id!r}, simulated={self.simulated})"


def kernel_boot_id(path: Path = KERNEL_BOOT_ID) -> str:
    return path.read_text().strip()


def new_lab_boot(state_dir: Path) -> str:
    """The lab machine boots again: a new boot id in its state directory."""
    boot_id = str(uuid.uuid4())
    state_dir.mkdir(parents=True, exist_ok=True)
    temporary = state_dir / f".{LAB_BOOT_ID}.tmp"
    temporary.write_text(boot_id + "\n")
    os.replace(temporary, state_dir / LAB_BOOT_ID)  # a reader sees the old id or the new one
    return boot_id


def lab_boot_id(state_dir: Path) -> str:
    """The lab machine's current boot; its first start is a boot too."""
    try:
        boot_id = (state_dir / LAB_BOOT_ID).read_text().strip()
    except FileNotFoundError:
        return new_lab_boot(state_dir)
    return boot_id or new_lab_boot(state_dir)


def machine_boot(lab: bool, state_dir: Path | None) -> BootIdentity:
    """The boot of the machine this agent runs on: the kernel's on a real machine, the state
    directory's for a machine of the lab. A lab machine without a state directory (an agent
    made inside a test's process) boots with its agent object."""
    if not lab:
        return BootIdentity(kernel_boot_id(), simulated=False)
    if state_dir is None:
        return BootIdentity(str(uuid.uuid4()), simulated=True)
    return BootIdentity(lab_boot_id(state_dir), simulated=True)

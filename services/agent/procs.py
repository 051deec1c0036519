"""Processes the agent leaves running for the next agent on the same boot (O4), found again by
pid and start time: a pid reused since by another program is not taken for them."""

from __future__ import annotations

import asyncio
import os
import signal


def start_ticks(pid: int) -> int | None:
    """When `pid` started, in clock ticks since boot (/proc/<pid>/stat field 22); None if no
    such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
    except OSError:
        return None
    # Fields after the command name (which may hold spaces) start at the last ')'.
    fields = stat[stat.rindex(b")") + 2 :].split()
    if fields[0] == b"Z":  # ended, not yet reaped by its parent
        return None
    return int(fields[19])


def alive(pid: int, ticks: int) -> bool:
    return pid > 0 and start_ticks(pid) == ticks


async def exited(pid: int) -> None:
    """Until process `pid` (a child of ours or not) has ended: a pidfd turns readable then."""
    loop = asyncio.get_running_loop()
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    ended: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not ended.done():
            ended.set_result(None)

    loop.add_reader(fd, readable)
    try:
        await ended
    finally:
        loop.remove_reader(fd)
        os.close(fd)


def kill_group(pid: int, ticks: int, sig: int = signal.SIGKILL) -> bool:
    """Signal the process group `pid` leads (started with start_new_session: its children,
    wireguard-go say, go with it), if `pid` is still the process started at `ticks`."""
    if not alive(pid, ticks):
        return False
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:  # not a group leader after all: the process alone
        os.kill(pid, sig)
    return True

"""The ranks an agent runs: the Job's command with the rank's environment (G8), its output in a
log a user can read (`nodus logs`), its exit reported in `nodus-ranks`."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Literal

import msgspec

from libs.bus import Bucket
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.lifecycle import RankProcess, RankStatus
from libs.runtime.tasks import cancel_and_wait
from services.agent import procs
from services.agent.boot import BootIdentity

log = logging.getLogger("nodus.agent.ranks")

KEEPER = str(Path(__file__).with_name("rankkeeper.py"))  # run by path: `-I`, no imports of ours


def _alive(remembered: RankProcess) -> bool:
    return procs.alive(remembered.pid, remembered.start_ticks)


def kill_remembered(log_dir: Path) -> int:
    """Kill every rank whose record is in `log_dir` and still runs (its keeper's group): the
    lab machine powers off. Returns how many."""
    killed = 0
    for path in log_dir.glob("*.pid"):
        try:
            remembered = msgspec.json.decode(path.read_bytes(), type=RankProcess)
        except (OSError, msgspec.DecodeError):
            continue
        killed += procs.kill_group(remembered.pid, remembered.start_ticks)
    return killed


class Rank:
    """A rank this agent watches: one it launched (its keeper is a child of this process), or
    one it adopted from the agent before it on the same boot (`process` is None then)."""

    def __init__(
        self,
        status: RankStatus,
        pid: int,
        log_path: Path,
        process: asyncio.subprocess.Process | None = None,
    ) -> None:
        self.status = status
        self.pid = pid  # the keeper's, which leads the rank's process group
        self.process = process
        self.log_path = log_path
        self.waiter: asyncio.Task[None] | None = None

    async def wait(self) -> None:
        if self.process is not None:
            await self.process.wait()
        else:
            await procs.exited(self.pid)


class RankRunner:
    def __init__(self, node: str, ranks: Bucket[RankStatus], log_dir: Path) -> None:
        self.node = node
        self.ranks = ranks
        self.log_dir = log_dir
        self.running: dict[str, Rank] = {}
        self._launching = asyncio.Lock()
        self.boot_id = ""  # the machine's boot, from `resume`: launched ranks carry it

    def log_path(self, gang: str, epoch: int, rank: int) -> Path:
        return self.log_dir / f"{names.rank_key(gang, epoch, rank, self.node)}.log"

    def _pid_path(self, key: str) -> Path:
        return self.log_dir / f"{key}.pid"

    def _exit_path(self, key: str) -> Path:
        return self.log_dir / f"{key}.exit"

    def _exit_code(self, key: str) -> int | None:
        """The rank's return code as its keeper recorded it; None: the keeper was killed (the
        rank was stopped with it) or never wrote one."""
        try:
            return int(self._exit_path(key).read_text().strip())
        except (OSError, ValueError):
            return None

    async def resume(self, boot: BootIdentity) -> tuple[int, int]:
        """The ranks the machine ran before this agent started (O4). On the same boot they
        still run, and are adopted: watched, and their exit reported, as if launched here. Of
        another boot (the lab's reboot leaves them alive on the shared kernel) they are killed
        and, like those a real reboot ended, recorded Stopped by the platform (the gang is
        placed again, R16), not failed. Returns (adopted, stopped)."""
        self.boot_id = boot.boot_id
        adopted = stopped = 0
        for path in sorted(self.log_dir.glob("*.pid")):
            try:
                remembered = msgspec.json.decode(path.read_bytes(), type=RankProcess)
            except (OSError, msgspec.DecodeError) as error:
                log.warning("%s: not a rank's process record (%s); removed", path, error)
                path.unlink(missing_ok=True)
                continue
            key = names.rank_key(
                remembered.status.gang, remembered.status.epoch, remembered.status.rank, self.node
            )
            if remembered.boot_id == boot.boot_id:
                entry = Rank(remembered.status, remembered.pid, self.log_path_of(remembered))
                self.running[key] = entry
                if _alive(remembered):
                    log.info("rank %s of this boot adopted (keeper pid %d)", key, entry.pid)
                    entry.waiter = asyncio.create_task(self._wait(key, entry))
                else:  # it ended while no agent watched: its keeper left the code
                    await self._conclude(key, entry)
                adopted += 1
                continue
            # Another boot's. A real reboot ended it; the pid may be another process now.
            if boot.simulated or not remembered.boot_id:
                procs.kill_group(remembered.pid, remembered.start_ticks)
            status = msgspec.structs.replace(remembered.status, state="Stopped", ended_time=now())
            await self.ranks.put(key, status)
            path.unlink(missing_ok=True)
            self._exit_path(key).unlink(missing_ok=True)
            log.info("rank %s of the machine's previous boot stopped", key)
            stopped += 1
        return adopted, stopped

    def log_path_of(self, remembered: RankProcess) -> Path:
        s = remembered.status
        return Path(s.log) if s.log else self.log_path(s.gang, s.epoch, s.rank)

    async def launch(
        self,
        gang: str,
        epoch: int,
        rank: int,
        command: list[str],
        env: dict[str, str],
    ) -> bool:
        """Start the rank once: a launch asked again (its answer lost on the bus, or asked of
        the agent after this one on the same machine) finds it running or its record
        written, and starts nothing; False then."""
        key = names.rank_key(gang, epoch, rank, self.node)
        async with self._launching:  # a try asked again while the first still writes
            if key in self.running or await self.ranks.get(key) is not None:
                return False
            return await self._start(key, gang, epoch, rank, command, env)

    async def _start(
        self, key: str, gang: str, epoch: int, rank: int, command: list[str], env: dict[str, str]
    ) -> bool:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        path = self.log_path(gang, epoch, rank)
        process_env = {
            k: v
            for k, v in os.environ.items()
            if k in ("PATH", "HOME", "LANG", "TMPDIR", "PYTHONPATH")
        }
        process_env.update(env)
        self._exit_path(key).unlink(missing_ok=True)
        with open(path, "ab") as output:  # noqa: ASYNC230 - a local log, once per rank
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-I",
                KEEPER,
                str(self._exit_path(key)),
                "--",
                *command,
                env=process_env,
                stdout=output,
                stderr=asyncio.subprocess.STDOUT,
                stdin=asyncio.subprocess.DEVNULL,
                start_new_session=True,
            )
        status = RankStatus(
            gang=gang,
            epoch=epoch,
            rank=rank,
            node=self.node,
            state="Running",
            started_time=now(),
            log=str(path),
        )
        ticks = procs.start_ticks(process.pid)
        if ticks is not None:
            remembered = RankProcess(
                status=status, pid=process.pid, start_ticks=ticks, boot_id=self.boot_id
            )
            self._pid_path(key).write_bytes(msgspec.json.encode(remembered))
        await self.ranks.put(key, status)
        entry = Rank(status, process.pid, path, process)
        self.running[key] = entry
        entry.waiter = asyncio.create_task(self._wait(key, entry))
        log.info("started rank %d of %s epoch %d (keeper pid %d)", rank, gang, epoch, process.pid)
        return True

    async def _wait(self, key: str, entry: Rank) -> None:
        await entry.wait()
        await self._conclude(key, entry)

    async def _conclude(self, key: str, entry: Rank) -> None:
        code = self._exit_code(key)
        stopped = entry.status.state == "Stopped"
        if code is None and not stopped:
            code = -signal.SIGKILL  # the keeper was killed, and the rank with it
        state: Literal["Exited", "Stopped"] = "Stopped" if stopped else "Exited"
        entry.status = msgspec.structs.replace(
            entry.status, node=self.node, state=state, exit_code=code, ended_time=now()
        )
        await self.ranks.put(key, entry.status)
        self._pid_path(key).unlink(missing_ok=True)
        self._exit_path(key).unlink(missing_ok=True)
        log.info("rank %s exited with %s", key, code)

    async def stop(self, gang: str, epoch: int | None = None, grace: float = 5.0) -> int:
        """SIGTERM the ranks of a gang (one epoch or all), SIGKILL what outlives the grace."""
        stopped = 0
        for key, entry in list(self.running.items()):
            if entry.status.gang != gang or (epoch is not None and entry.status.epoch != epoch):
                continue
            if entry.waiter is not None and not entry.waiter.done():
                entry.status.state = "Stopped"
                try:
                    os.killpg(entry.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
                try:
                    await asyncio.wait_for(asyncio.shield(entry.waiter), grace)
                except TimeoutError:
                    try:
                        os.killpg(entry.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                stopped += 1
            if entry.waiter is not None:
                await entry.waiter
            self.running.pop(key, None)
        return stopped

    def read_log(
        self, gang: str, epoch: int, rank: int, offset: int, limit: int
    ) -> tuple[str, int]:
        path = self.log_path(gang, epoch, rank)
        try:
            with open(path, "rb") as handle:
                handle.seek(offset)
                data = handle.read(limit)
        except FileNotFoundError:
            return "", offset
        return data.decode(errors="replace"), offset + len(data)

    async def stop_all(self) -> None:
        for gang in {e.status.gang for e in self.running.values()}:
            await self.stop(gang)

    async def release(self) -> None:
        """Stop watching, leave the ranks running (the agent stops, the machine does not):
        the next agent on this boot adopts them from their records."""
        waiters = [e.waiter for e in self.running.values() if e.waiter is not None]
        await cancel_and_wait(waiters)
        self.running.clear()

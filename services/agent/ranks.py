"""The ranks an agent runs: the Job's command with the rank's environment (G8), its output in a
log a user can read (`nodus logs`), its exit reported in `nodus-ranks`."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from pathlib import Path
from typing import Literal

import msgspec

from libs.bus import Bucket
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.lifecycle import RankStatus

log = logging.getLogger("nodus.agent.ranks")


class RankProcess(msgspec.Struct):
    """A running rank's process as the machine's disk remembers it (`<rank key>.pid` beside its
    log), so that an agent starting again finds the ranks of its previous boot."""

    status: RankStatus
    pid: int
    start_ticks: int  # /proc/<pid>/stat's start time: a pid reused since is not the rank


def _start_ticks(pid: int) -> int | None:
    """When `pid` started, in clock ticks since boot; None if no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            stat = handle.read()
    except OSError:
        return None
    # Fields after the command name (which may hold spaces) start at the last ')'.
    return int(stat[stat.rindex(b")") + 2 :].split()[19])


class Rank:
    def __init__(
        self, status: RankStatus, process: asyncio.subprocess.Process, log_path: Path
    ) -> None:
        self.status = status
        self.process = process
        self.log_path = log_path
        self.waiter: asyncio.Task[None] | None = None


class RankRunner:
    def __init__(self, node: str, ranks: Bucket[RankStatus], log_dir: Path) -> None:
        self.node = node
        self.ranks = ranks
        self.log_dir = log_dir
        self.running: dict[str, Rank] = {}

    def log_path(self, gang: str, epoch: int, rank: int) -> Path:
        return self.log_dir / f"{names.rank_key(gang, epoch, rank, self.node)}.log"

    def _pid_path(self, key: str) -> Path:
        return self.log_dir / f"{key}.pid"

    async def stop_previous_boot(self) -> int:
        """The ranks the machine ran before this agent started: a booted machine runs none, so
        any still alive (the agent was killed, its ranks were not) are killed, and each is
        recorded Stopped by the platform (its gang is placed again, R16), not failed."""
        stopped = 0
        for path in sorted(self.log_dir.glob("*.pid")):
            try:
                remembered = msgspec.json.decode(path.read_bytes(), type=RankProcess)
            except (OSError, msgspec.DecodeError) as error:
                log.warning("%s: not a rank's process record (%s); removed", path, error)
                path.unlink(missing_ok=True)
                continue
            if _start_ticks(remembered.pid) == remembered.start_ticks:
                try:
                    os.killpg(remembered.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            status = msgspec.structs.replace(remembered.status, state="Stopped", ended_time=now())
            key = names.rank_key(status.gang, status.epoch, status.rank, self.node)
            await self.ranks.put(key, status)
            path.unlink(missing_ok=True)
            log.info("rank %s of the machine's previous boot stopped", key)
            stopped += 1
        return stopped

    async def launch(
        self, gang: str, epoch: int, rank: int, command: list[str], env: dict[str, str]
    ) -> bool:
        key = names.rank_key(gang, epoch, rank, self.node)
        if key in self.running:
            return False  # idempotent: a retried launch starts nothing more
        self.log_dir.mkdir(parents=True, exist_ok=True)
        path = self.log_path(gang, epoch, rank)
        process_env = {
            k: v
            for k, v in os.environ.items()
            if k in ("PATH", "HOME", "LANG", "TMPDIR", "PYTHONPATH")
        }
        process_env.update(env)
        with open(path, "ab") as output:  # noqa: ASYNC230 - a local log, once per rank
            try:
                process = await asyncio.create_subprocess_exec(
                    *command,
                    env=process_env,
                    stdout=output,
                    stderr=asyncio.subprocess.STDOUT,
                    stdin=asyncio.subprocess.DEVNULL,
                    start_new_session=True,
                )
            except OSError as error:
                output.write(f"nodus: cannot start {command[0]}: {error}\n".encode())
                status = RankStatus(
                    gang=gang,
                    epoch=epoch,
                    rank=rank,
                    node=self.node,
                    state="Exited",
                    started_time=now(),
                    exit_code=127,
                    ended_time=now(),
                    log=str(path),
                )
                await self.ranks.put(key, status)
                return False
        status = RankStatus(
            gang=gang,
            epoch=epoch,
            rank=rank,
            node=self.node,
            state="Running",
            started_time=now(),
            log=str(path),
        )
        ticks = _start_ticks(process.pid)
        if ticks is not None:
            remembered = RankProcess(status=status, pid=process.pid, start_ticks=ticks)
            self._pid_path(key).write_bytes(msgspec.json.encode(remembered))
        await self.ranks.put(key, status)
        entry = Rank(status, process, path)
        self.running[key] = entry
        entry.waiter = asyncio.create_task(self._wait(key, entry))
        log.info("started rank %d of %s epoch %d (pid %d)", rank, gang, epoch, process.pid)
        return True

    async def _wait(self, key: str, entry: Rank) -> None:
        code = await entry.process.wait()
        state: Literal["Exited", "Stopped"] = (
            "Stopped" if entry.status.state == "Stopped" else "Exited"
        )
        entry.status = RankStatus(
            gang=entry.status.gang,
            epoch=entry.status.epoch,
            rank=entry.status.rank,
            node=self.node,
            state=state,
            started_time=entry.status.started_time,
            exit_code=code,
            ended_time=now(),
            log=entry.status.log,
        )
        await self.ranks.put(key, entry.status)
        self._pid_path(key).unlink(missing_ok=True)
        log.info("rank %s exited with %d", key, code)

    async def stop(self, gang: str, epoch: int | None = None, grace: float = 5.0) -> int:
        """SIGTERM the ranks of a gang (one epoch or all), SIGKILL what outlives the grace."""
        stopped = 0
        for key, entry in list(self.running.items()):
            if entry.status.gang != gang or (epoch is not None and entry.status.epoch != epoch):
                continue
            if entry.process.returncode is None:
                entry.status.state = "Stopped"
                try:
                    os.killpg(entry.process.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
                try:
                    await asyncio.wait_for(entry.process.wait(), grace)
                except TimeoutError:
                    os.killpg(entry.process.pid, signal.SIGKILL)
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

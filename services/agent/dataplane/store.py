"""The epochs an agent joined, on the machine's disk (O4): `STATE/epochs/<joinkey key>/` holds
`state.json` (the epoch as its join key brought it, this member, what its dataplane runs),
`wg.key` (the epoch's WireGuard private key, mode 0600), `process.json` (the dataplane
process: pid, start time, boot) and the dataplane's control socket. The directory is 0700.

Each file is written to a temporary name and renamed, so a reader (the next agent, after a
SIGKILL at any moment) finds the old content or the new, never half of one."""

from __future__ import annotations

import base64
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import msgspec

from libs.contracts.base import decode, encode
from libs.contracts.dataplane import DataplaneProcess, EpochState
from services.agent.dataplane.control import SOCKET

log = logging.getLogger("nodus.agent.dataplane.store")

STATE = "state.json"
KEY = "wg.key"
PROCESS = "process.json"
FAILED = "failed.txt"  # why the last dataplane process gave up, for the agent to say


def _write(path: Path, data: bytes, mode: int = 0o600) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temporary, path)


@dataclass
class Stored:
    """One joined epoch as read back."""

    state: EpochState
    wg_private: bytes
    process: DataplaneProcess | None
    directory: Path


class EpochStore:
    def __init__(self, state_dir: Path) -> None:
        self.root = state_dir / "epochs"

    def directory(self, key: str) -> Path:
        return self.root / key

    def socket(self, key: str) -> Path:
        return self.directory(key) / SOCKET

    def save(self, state: EpochState, wg_private: bytes) -> Path:
        directory = self.directory(state.key)
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(directory, 0o700)
        _write(directory / KEY, base64.b64encode(wg_private) + b"\n")
        _write(directory / STATE, encode(state))
        return directory

    def save_process(self, key: str, process: DataplaneProcess) -> None:
        _write(self.directory(key) / PROCESS, encode(process))

    def forget_process(self, key: str) -> None:
        (self.directory(key) / PROCESS).unlink(missing_ok=True)

    def save_failure(self, key: str, why: str) -> None:
        _write(self.directory(key) / FAILED, why.encode())

    def take_failure(self, key: str) -> str | None:
        """Why the last process gave up, once (the next process starts with a clean slate)."""
        path = self.directory(key) / FAILED
        try:
            why = path.read_text()
        except FileNotFoundError:
            return None
        path.unlink(missing_ok=True)
        return why

    def remove(self, key: str) -> None:
        shutil.rmtree(self.directory(key), ignore_errors=True)

    def load(self, key: str) -> Stored:
        directory = self.directory(key)
        state = decode((directory / STATE).read_bytes(), EpochState)
        wg_private = base64.b64decode((directory / KEY).read_bytes().strip(), validate=True)
        if len(wg_private) != 32:
            raise ValueError(f"{directory / KEY} does not hold a WireGuard key")
        try:
            process: DataplaneProcess | None = decode(
                (directory / PROCESS).read_bytes(), DataplaneProcess
            )
        except FileNotFoundError:
            process = None
        return Stored(state, wg_private, process, directory)

    def load_all(self) -> list[Stored]:
        """Every epoch on disk; one that cannot be read (a disk fault, a hand edit) is said and
        removed: its epoch cannot be re-adopted, and the probe or the placer ends it."""
        if not self.root.is_dir():
            return []
        found = []
        for directory in sorted(self.root.iterdir()):
            if not directory.is_dir():
                continue
            try:
                found.append(self.load(directory.name))
            except (OSError, ValueError, msgspec.DecodeError) as error:
                log.warning("epoch state %s is unreadable, dropped: %s", directory, error)
                self.remove(directory.name)
        return found

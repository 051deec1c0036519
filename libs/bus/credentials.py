"""The bus's users on disk (S1): each process's NKey seed in a file of its own (0600), and a
registry of who is who, from which the server's `authorization` block is written."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from libs.bus.auth import Identity, authorization, new_identity, public_key_of
from libs.contracts.errors import ErrorCode, NodusError

REGISTRY = "users.json"  # name -> role, node, public key, seed file: nothing secret


class BusUsers:
    """The identities of one bus, kept under `directory`."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._registry = directory / REGISTRY

    def ensure(
        self, name: str, role: str, node: str | None = None, seed_file: Path | None = None
    ) -> Path:
        """The seed file of `name`, made on first use; a second call returns the same user."""
        users = self._load()
        known = users.get(name)
        if known is not None:
            if (known["role"], known.get("node")) != (role, node):
                raise NodusError(
                    ErrorCode.CONFLICT,
                    f"bus user {name} exists as {known['role']} {known.get('node') or ''}".strip(),
                )
            path = Path(known["seed_file"])
            if path.exists():
                return path
        try:
            identity = new_identity(name, role, node)
        except ValueError as error:
            raise NodusError(ErrorCode.INVALID, f"bus user {name}: {error}") from None
        path = seed_file or self.directory / f"{name}.nk"
        write_secret(path, identity.seed + "\n")
        self._register(users, name, role, node, identity.public_key, path)
        return path

    def adopt(self, name: str, role: str, seed_file: Path, node: str | None = None) -> Path:
        """A user whose seed already exists elsewhere (the operator's own, say)."""
        self._register(self._load(), name, role, node, check_seed_file(seed_file), seed_file)
        return seed_file

    def _register(
        self,
        users: dict[str, dict[str, Any]],
        name: str,
        role: str,
        node: str | None,
        public_key: str,
        seed_file: Path,
    ) -> None:
        users[name] = {
            "role": role,
            "node": node,
            "public_key": public_key,
            "seed_file": str(seed_file),
        }
        self._save(users)

    def identities(self) -> list[Identity]:
        out = []
        for name, user in sorted(self._load().items()):
            seed = ""  # the server needs only the public key
            out.append(Identity(name, user["role"], seed, user["public_key"], user.get("node")))
        return out

    def seed_file(self, name: str) -> Path:
        users = self._load()
        if name not in users:
            raise NodusError(ErrorCode.NOT_FOUND, f"no bus user {name} in {self.directory}")
        return Path(users[name]["seed_file"])

    def authorization(self) -> dict[str, object]:
        return authorization(self.identities())

    def _load(self) -> dict[str, dict[str, Any]]:
        if not self._registry.exists():
            return {}
        try:
            users: dict[str, dict[str, Any]] = json.loads(self._registry.read_text())
        except ValueError as error:
            raise NodusError(ErrorCode.INVALID, f"{self._registry}: {error}") from None
        return users

    def _save(self, users: dict[str, dict[str, Any]]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        partial = self._registry.with_suffix(".tmp")
        partial.write_text(json.dumps(users, indent=2, sort_keys=True) + "\n")
        partial.replace(self._registry)


def write_secret(path: Path, text: str) -> None:
    """Written 0600 from the start: a seed is never readable by others, even for a moment."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".tmp")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    partial.replace(path)


def check_seed_file(path: Path) -> str:
    """The public key of a seed file, or a clear error naming the file."""
    try:
        return public_key_of(path.read_text())
    except (OSError, ValueError) as error:
        raise NodusError(ErrorCode.INVALID, f"bus credentials {path}: {error}") from None

"""The remediator's config file (`nodus remediator --config`): its `providers:` section read
and checked, each problem named with its file and field (S3)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import yaml

from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.files import load_yaml_file
from libs.contracts.providers import (
    DEFAULT_POOL,
    SUPPORTED,
    Credentials,
    PoolProvider,
    ProviderKind,
    RemediatorConfig,
)
from libs.contracts.remediation import Action

# Without a config file: the lab's provider for every pool (`nodus up`).
LAB_CONFIG = RemediatorConfig(providers={DEFAULT_POOL: PoolProvider(kind=ProviderKind.LOCAL)})


def load_config(path: Path | None) -> RemediatorConfig:
    if path is None:
        return LAB_CONFIG
    config = load_yaml_file(path, RemediatorConfig, "remediator config", empty_ok=True)
    try:
        check(config)
    except NodusError as error:
        raise NodusError(error.code, f"remediator config {path}: {error.message}") from None
    return config if config.providers else LAB_CONFIG


def _bad(message: str, where: str) -> NodusError:
    return NodusError(ErrorCode.INVALID, f"{where}: {message}", field=where)


def check(config: RemediatorConfig) -> None:
    """What the types cannot say: each action goes to a kind that can do it, each kind used
    has its settings, each command an operator routes to exec exists."""
    for pool, entry in config.providers.items():
        where = f"$.providers[{pool!r}]"
        for action, kind in entry.actions.items():
            if action is Action.NONE:
                raise _bad("None is not an action", f"{where}.actions")
            if action not in SUPPORTED[kind]:
                can = ", ".join(sorted(a.value for a in SUPPORTED[kind]))
                raise _bad(
                    f"{kind.value} cannot carry out {action.value} (it does {can})",
                    f"{where}.actions",
                )
        used = {entry.kind, *entry.actions.values()}
        if ProviderKind.REDFISH in used:
            if entry.redfish is None:
                raise _bad("kind redfish needs a `redfish:` section (bmcs, credentialsFile)", where)
            if not entry.redfish.bmcs and not entry.redfish.address_template:
                raise _bad("give bmcs (node -> BMC URL) or addressTemplate", f"{where}.redfish")
            if entry.redfish.address_template and "{node}" not in entry.redfish.address_template:
                raise _bad(
                    "addressTemplate must contain {node}", f"{where}.redfish.addressTemplate"
                )
        if ProviderKind.EXEC in used:
            if entry.exec is None:
                raise _bad("kind exec needs an `exec:` section (commands per action)", where)
            routed = [a for a, k in entry.actions.items() if k is ProviderKind.EXEC]
            for action in routed:
                if action not in entry.exec.commands:
                    raise _bad(
                        f"{action.value} goes to exec but exec.commands has no {action.value}",
                        f"{where}.exec.commands",
                    )
            if entry.kind is ProviderKind.EXEC and not entry.exec.commands:
                raise _bad("exec.commands is empty", f"{where}.exec.commands")


def load_credentials(path: str) -> Credentials:
    """The BMC's user, from a file of its own (never the config): YAML or JSON
    `{username, password}`."""
    try:
        raw = yaml.safe_load(Path(path).read_text())
    except OSError as error:
        raise NodusError(ErrorCode.INVALID, f"BMC credentials {path}: {error.strerror}") from None
    except yaml.YAMLError:
        raise NodusError(ErrorCode.INVALID, f"BMC credentials {path}: not valid YAML") from None
    try:
        return msgspec.convert(raw, Credentials)
    except msgspec.ValidationError as error:
        # The message names the field, never its value: the file holds a password.
        raise NodusError(
            ErrorCode.INVALID, f"BMC credentials {path}: {error} (want username, password)"
        ) from None

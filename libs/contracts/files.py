"""Reading the YAML files operators write (the fleet, the placer's config) into contracts."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import msgspec
import yaml

from libs.contracts.base import convert
from libs.contracts.errors import ErrorCode, NodusError

T = TypeVar("T")


def load_yaml_file(path: Path, kind: type[T], what: str, empty_ok: bool = False) -> T:
    """A YAML file read into a Struct; every problem names `what`, the file and the field."""
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as error:
        raise NodusError(ErrorCode.INVALID, f"{what} {path}: {error.strerror}") from None
    except yaml.YAMLError as error:
        raise NodusError(ErrorCode.INVALID, f"{what} {path}: not valid YAML: {error}") from None
    try:
        return convert({} if raw is None and empty_ok else raw, kind)
    except msgspec.ValidationError as error:
        raise NodusError(ErrorCode.INVALID, f"{what} {path}: {error}") from None

"""The base every message and record derives from: camelCase JSON, unknown fields refused."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, TypeVar

import msgspec

# A DNS label: safe as a NATS subject token and as a KV key part.
Name = Annotated[
    str,
    msgspec.Meta(
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        max_length=63,
        description="lower-case letters, digits and '-', at most 63 characters",
    ),
]


class Record(msgspec.Struct, rename="camel", forbid_unknown_fields=True, omit_defaults=True):
    """Base of every message and record: JSON with camelCase fields, unknown fields refused."""


T = TypeVar("T")

_encoder = msgspec.json.Encoder()


def encode(value: Any) -> bytes:
    return _encoder.encode(value)


def decode(data: bytes | str, kind: type[T]) -> T:
    return msgspec.json.decode(data, type=kind)


def to_builtins(value: Any) -> Any:
    return msgspec.to_builtins(value)


def convert(obj: Any, kind: type[T]) -> T:
    """Builtins (from YAML or JSON) to a Struct, validating every field."""
    return msgspec.convert(obj, type=kind, strict=False)


def now() -> datetime:
    return datetime.now(UTC)

"""Errors with stable codes, the same on the bus, in the CLI and in the Python client."""

from __future__ import annotations

from enum import StrEnum

from libs.contracts.base import Record


class ErrorCode(StrEnum):
    # Input
    INVALID = "Invalid"  # malformed YAML/JSON, wrong type, unknown field, out of range
    NOT_FOUND = "NotFound"
    ALREADY_EXISTS = "AlreadyExists"
    IMMUTABLE = "Immutable"
    # Admission (G1, G2, G8, C4, C5, C6, G21)
    ACCESS_DENIED = "DistributedAccessDenied"
    RELAYED_MEMBERS = "RelayedMemberLimit"
    LD_PRELOAD_WITH_AUTO = "LdPreloadWithAuto"
    UNSATISFIABLE = "Unsatisfiable"
    BACKEND_MISMATCH = "BackendMismatch"
    MISSING_CAPABILITY = "MissingCapability"
    BAD_ADDRESS = "BadAddress"
    NOT_QUALIFIED = "NotQualified"
    BOUNDS_EXCEEDED = "BoundsExceeded"
    # Bus and epochs (C1, C2, C7)
    NO_RESPONDERS = "NoResponders"
    TIMEOUT = "Timeout"
    STALE_EPOCH = "StaleEpoch"
    EPOCH_MISMATCH = "EpochMismatch"
    JOURNAL_UNAVAILABLE = "JournalUnavailable"
    CONFLICT = "Conflict"
    # The bus refused the credentials at connect (S1); a refused act is a timeout instead.
    UNAUTHORIZED = "Unauthorized"
    # A member's advertised address is not on its machine (Direct's nodus0 not up, say).
    ADDRESS_UNAVAILABLE = "AddressUnavailable"
    INTERNAL = "Internal"


class ErrorReply(Record):
    """What a service answers instead of a result: a stable code and a readable message."""

    code: ErrorCode
    message: str
    field: str | None = None


class NodusError(Exception):
    """Raised anywhere in Nodus; carries the same code and message the bus carries."""

    def __init__(self, code: ErrorCode, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.field = field

    def __str__(self) -> str:
        return f"{self.code.value}: {self.message}"

    def to_reply(self) -> ErrorReply:
        return ErrorReply(code=self.code, message=self.message, field=self.field)

    @classmethod
    def from_reply(cls, reply: ErrorReply) -> NodusError:
        return cls(reply.code, reply.message, reply.field)

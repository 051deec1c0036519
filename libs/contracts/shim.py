"""What nodus-shim-check reports (libs/netshim runs it): whether the shim loads into a launcher."""

from __future__ import annotations

import msgspec


class SelfTestResult(msgspec.Struct, frozen=True, rename="camel"):
    """nodus-shim-check's report. `ok` = the shim loaded into the launcher; else `reason` is
    "ShimNotLoaded" (the launcher cannot load it: static, musl, other architecture, ...) or
    "CheckFailed" (launcher not found, shim missing), and `message` says why and what to do."""

    ok: bool
    exit_code: int
    reason: str | None
    launcher: str
    resolved: str | None
    target: str | None
    linkage: str  # glibc | musl | static | other | not-elf | unknown
    interpreter: str | None
    shim: str
    loaded: bool
    markers: list[str]
    loader_message: str | None
    launcher_status: str | None
    message: str

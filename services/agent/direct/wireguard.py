"""Which WireGuard runs `nodus0` on this machine (O5): the kernel's where the module exists,
else wireguard-go, and how to tell what that wireguard-go can do.

The kernel is asked the way netbird asks it: create a device of kind `wireguard` (a throwaway
name, deleted at once); a kernel without the module (or one that refuses to load it) says so.
`NODUS_WIREGUARD` (the agent's `--wireguard`) forces a side: `userspace` always runs
wireguard-go; `kernel` fails, with the kernel's reason, where the module is missing.

The agent announces the result in its node record and metrics, and warns about a wireguard-go
without offloads: bookworm's 0.0.20220316 moves packets one syscall at a time, about a fifth of
the speed of a build with the TUN offloads (TSO/GRO through virtio-net headers, 0.0.20230223)
and UDP GSO/GRO (0.0.20231211). What a binary can do is read from its Debian package's
version (dpkg), not from `wireguard-go --version`: bookworm-backports' 0.0.20231211 build
reports v0.0.20230223 (upstream did not bump it). A binary no package owns (one built or
copied by hand) is judged by its --version. The version, not a try: the agent announces before
any `nodus0` exists, and a running device's offloads are visible only to ethtool's ioctls.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Final, Literal, get_args

from prometheus_client import Gauge

from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.fleet import WireGuardInfo
from libs.runtime.processes import reaped

log = logging.getLogger("nodus.agent.wireguard")

Mode = Literal["auto", "kernel", "userspace"]
MODES: tuple[str, ...] = get_args(Mode)
MODE_ENV = "NODUS_WIREGUARD"  # auto | kernel | userspace
BINARY_ENV = "NODUS_WIREGUARD_GO"  # the wireguard-go to run (default: the one on PATH)
KERNEL: Final = "kernel"
USERSPACE: Final = "wireguard-go"
# 0.0.YYYYMMDD releases: the first with the TUN offloads and batched I/O.
OFFLOADS_SINCE = 20230223
PROBE_TIMEOUT = 5.0

INFO = Gauge(
    "nodus_agent_wireguard_info",
    "The WireGuard implementation nodus0 runs on this machine (always 1)",
    ["node", "implementation", "version", "offloads"],
)


def _fail(message: str) -> NodusError:
    return NodusError(ErrorCode.ADDRESS_UNAVAILABLE, f"nodus0: {message}")


def mode_from_env() -> Mode:
    value = os.environ.get(MODE_ENV, "auto").strip().lower() or "auto"
    if value not in MODES:
        raise _fail(f"{MODE_ENV}={value!r}: one of {', '.join(MODES)}")
    return value  # type: ignore[return-value]  # checked against MODES


def wireguard_go_binary() -> str | None:
    configured = os.environ.get(BINARY_ENV)
    if configured:
        return configured if os.access(configured, os.X_OK) else None
    return shutil.which("wireguard-go")


async def _output(*argv: str) -> tuple[int, str]:
    try:
        process = await asyncio.create_subprocess_exec(
            *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
        )
    except FileNotFoundError:
        return 127, f"{argv[0]} is not installed"
    try:
        async with reaped(process):
            out, _ = await asyncio.wait_for(process.communicate(), PROBE_TIMEOUT)
    except TimeoutError:
        return -1, f"{' '.join(argv)} did not answer in {PROBE_TIMEOUT:g} s"
    return process.returncode or 0, out.decode(errors="replace").strip()


async def try_kernel_device() -> str | None:
    """None when this kernel creates WireGuard devices; else why not (ip's own words)."""
    name = f"nodusk{secrets.token_hex(3)}"
    code, output = await _output("ip", "link", "add", name, "type", "wireguard")
    if code != 0:
        return output or f"ip exited {code}"
    await _output("ip", "link", "delete", name)
    return None


def kernel_version() -> str:
    """The module's own version (sysfs), else the kernel release it came with."""
    for source in (Path("/sys/module/wireguard/version"), Path("/proc/sys/kernel/osrelease")):
        try:
            return source.read_text().strip()
        except OSError:
            continue
    return ""


def release_date(version: str) -> int | None:
    """20231211 of `0.0.20231211-1~bpo12+1`, `v0.0.20230223`; None when not of that form."""
    found = re.search(r"0\.0\.(\d{8})", version)
    return int(found.group(1)) if found else None


def has_offloads(version: str) -> bool:
    date = release_date(version)
    return date is not None and date >= OFFLOADS_SINCE


def _resolved(binary: str) -> str:
    return os.path.realpath(binary)  # dpkg knows the file, not the symlink to it


async def _package_version(binary: str) -> str | None:
    """The version of the Debian package that installed `binary`, if one did."""
    if shutil.which("dpkg-query") is None:
        return None
    code, owner = await _output("dpkg-query", "-S", _resolved(binary))
    if code != 0 or ":" not in owner:
        return None  # no package owns it
    package = owner.split(":", 1)[0].split(",")[0].strip()
    code, version = await _output("dpkg-query", "-W", "-f=${Version}", package)
    return version if code == 0 and version else None


async def wireguard_go_version(binary: str) -> str:
    package = await _package_version(binary)
    if package is not None:
        return package
    _, output = await _output(binary, "--version")
    found = re.search(r"v?(\d+\.\d+\.\d+\S*)", output)
    return found.group(1) if found else "unknown"


async def choose(mode: Mode, binary: str | None = None) -> WireGuardInfo:
    """The WireGuard `nodus0` will run under `mode`; NodusError when that mode cannot run."""
    if mode != "userspace":
        refused = await try_kernel_device()
        if refused is None:
            return WireGuardInfo(implementation=KERNEL, version=kernel_version(), offloads=True)
        if mode == "kernel":
            raise _fail(
                f"{MODE_ENV}=kernel, but this kernel creates no WireGuard device: {refused}"
            )
        log.debug("no kernel WireGuard (%s): wireguard-go", refused)
    binary = binary or wireguard_go_binary()
    if binary is None:
        where = os.environ.get(BINARY_ENV) or "on PATH"
        raise _fail(f"wireguard-go is not installed ({where}; deploy/dev/system-deps.sh)")
    version = await wireguard_go_version(binary)
    return WireGuardInfo(
        implementation=USERSPACE, version=version, offloads=has_offloads(version), binary=binary
    )


_CHOSEN: WireGuardInfo | None = None


async def chosen() -> WireGuardInfo:
    """This process's choice, made once from the environment (`NODUS_WIREGUARD`,
    `NODUS_WIREGUARD_GO`): the agent and every nodus0 it makes agree."""
    global _CHOSEN
    if _CHOSEN is None:  # two callers at once probe twice, and agree
        _CHOSEN = await choose(mode_from_env())
    return _CHOSEN


def announce(node: str, info: WireGuardInfo) -> None:
    """The metric, and the log line an operator looks for."""
    INFO.labels(node, info.implementation, info.version, str(info.offloads).lower()).set(1)
    if info.implementation == USERSPACE and not info.offloads:
        log.warning(
            "%s: wireguard-go %s has no TUN/UDP offloads: Direct gangs will run at a fraction "
            "of the wire's speed; install wireguard-go >= 0.0.20231211 (Debian: "
            "bookworm-backports, deploy/dev/system-deps.sh) or use the kernel's WireGuard",
            node,
            info.version,
        )
    else:
        log.info("%s: nodus0 runs %s %s", node, info.implementation, info.version)


async def for_agent(node: str) -> WireGuardInfo | None:
    """The agent's start: choose, announce. A forced mode that cannot run stops the agent (its
    operator asked for it); `auto` with no WireGuard at all leaves Direct epochs to fail alone."""
    try:
        info = await chosen()
    except NodusError as error:
        if mode_from_env() != "auto":
            raise
        log.warning("%s: no WireGuard for Direct gangs: %s", node, error.message)
        return None
    announce(node, info)
    return info

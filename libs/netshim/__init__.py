"""The shim from Python: where libnodus-netshim.so is, building it, and its self-test.

    from libs import netshim
    netshim.ensure_built()                          # make -C netshim, when anything is stale
    result = netshim.self_test(["python3", "-c", "pass"])
    if not result.ok:
        fail_job(result.reason, result.message)     # reason "ShimNotLoaded" (G12, G20)

`self_test` runs `nodus-shim-check --json` (netshim/src/check.c), the same static program the
runner runs inside an image, and decodes its report. The C program is the implementation:
it must run in images that have no Python (or a musl one), so there is exactly one.
"""

from __future__ import annotations

import asyncio
import fcntl
import math
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TypedDict, Unpack

import msgspec

from libs.contracts.shim import SelfTestResult
from libs.runtime.processes import reaped

__all__ = [
    "BUILD_DIR",
    "CHECK_PATH",
    "ENV_DEBUG",
    "ENV_MARKER",
    "ENV_PEERS",
    "ENV_SOCKS",
    "ENV_TIMEOUT_MS",
    "EXIT_CHECK_FAILED",
    "EXIT_LOADED",
    "EXIT_NOT_LOADED",
    "EXIT_USAGE",
    "NETSHIM_DIR",
    "SHIM_NOT_LOADED",
    "SHIM_PATH",
    "TEST_PROGRAMS",
    "NetshimBuildError",
    "NetshimCheckError",
    "SelfTestOptions",
    "SelfTestResult",
    "ensure_built",
    "preload_env",
    "self_test",
    "self_test_async",
    "shim_env",
]

NETSHIM_DIR = Path(__file__).resolve().parents[2] / "netshim"
BUILD_DIR = NETSHIM_DIR / "build"
SHIM_PATH = BUILD_DIR / "libnodus-netshim.so"
CHECK_PATH = BUILD_DIR / "nodus-shim-check"
TEST_PROGRAMS = BUILD_DIR / "tests"

ENV_PEERS = "NODUS_NETSHIM_PEERS"
ENV_SOCKS = "NODUS_NETSHIM_SOCKS"
ENV_TIMEOUT_MS = "NODUS_NETSHIM_TIMEOUT_MS"
ENV_DEBUG = "NODUS_NETSHIM_DEBUG"
ENV_MARKER = "NODUS_NETSHIM_MARKER"

SHIM_NOT_LOADED = "ShimNotLoaded"  # the Job failure reason (G12)

# nodus-shim-check's exit status
EXIT_LOADED = 0
EXIT_NOT_LOADED = 1
EXIT_USAGE = 2
EXIT_CHECK_FAILED = 3

_SOURCES = ("src", "tests", "Makefile")
_OUTPUTS = (SHIM_PATH, CHECK_PATH, TEST_PROGRAMS / "nbconnect", TEST_PROGRAMS / "netbench")


class NetshimBuildError(RuntimeError):
    """`make -C netshim` failed; the message ends with its output."""


class NetshimCheckError(RuntimeError):
    """nodus-shim-check could not be run or gave no report (not the same as ShimNotLoaded)."""


def _newest_source() -> float:
    newest = 0.0
    for name in _SOURCES:
        path = NETSHIM_DIR / name
        paths = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        for p in paths:
            newest = max(newest, p.stat().st_mtime)
    return newest


def _stale() -> bool:
    if not all(p.exists() for p in _OUTPUTS):
        return True
    oldest = min(p.stat().st_mtime for p in _OUTPUTS)
    return _newest_source() > oldest


def ensure_built(*, force: bool = False, timeout: float = 300.0) -> Path:
    """Builds netshim/ (the shim, nodus-shim-check, the test programs) unless it is up to
    date; returns the shim's path. Safe to call from several processes at once."""
    if not force and not _stale():
        return SHIM_PATH
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    with open(BUILD_DIR / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if force or _stale():
            try:
                done = subprocess.run(
                    ["make", "-C", str(NETSHIM_DIR), "all"],
                    capture_output=True,
                    text=True,
                    timeout=timeout,
                    check=False,
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise NetshimBuildError(f"make -C {NETSHIM_DIR} could not run: {exc}") from exc
            if done.returncode != 0:
                output = (done.stdout + done.stderr)[-4000:]
                raise NetshimBuildError(
                    f"make -C {NETSHIM_DIR} failed ({done.returncode}); needs gcc and make "
                    f"(make system-deps):\n{output}"
                )
    return SHIM_PATH


def shim_env(
    *,
    peers: Sequence[str],
    socks: str,
    shim: Path | str = SHIM_PATH,
    preload: str = "",
    debug: bool = False,
) -> dict[str, str]:
    """The variables that load the shim into a program and tell it where to go (G8): the shim
    first in LD_PRELOAD, then `preload` (what the program's LD_PRELOAD would have held), the
    peers it redirects and the SOCKS endpoint it redirects them to. The one rendering of them:
    the placer puts these in every rank's environment of a Relayed gang."""
    env = {
        "LD_PRELOAD": ":".join(p for p in (str(shim), preload) if p),
        ENV_PEERS: ",".join(peers),
        ENV_SOCKS: socks,
    }
    if debug:
        env[ENV_DEBUG] = "1"
    return env


def preload_env(
    base: Mapping[str, str],
    *,
    peers: Sequence[str],
    socks: str,
    shim: Path | str = SHIM_PATH,
    debug: bool = False,
) -> dict[str, str]:
    """`base` with the shim preloaded the way the placer renders it (`shim_env`), before what
    `base`'s LD_PRELOAD held."""
    env = dict(base)
    env.update(
        shim_env(
            peers=peers, socks=socks, shim=shim, preload=env.get("LD_PRELOAD", ""), debug=debug
        )
    )
    return env


class SelfTestOptions(TypedDict, total=False):
    """How the check runs: `shim` and `check` (default: the built ones, built when stale),
    `timeout` (seconds the launcher may take, 30 by default), `env` (default: ours)."""

    shim: Path | str | None
    check: Path | str | None
    timeout: float
    env: Mapping[str, str] | None


def _command(launcher: Sequence[str], options: SelfTestOptions) -> list[str]:
    if not launcher:
        raise ValueError("self_test needs a launcher command")
    shim, check = options.get("shim"), options.get("check")
    if shim is None or check is None:
        ensure_built()
    return [
        str(check or CHECK_PATH),
        "--json",
        "--shim",
        str(shim or SHIM_PATH),
        "--timeout",
        str(max(1, math.ceil(_timeout(options)))),
        "--",
        *launcher,
    ]


def _timeout(options: SelfTestOptions) -> float:
    return options.get("timeout", 30.0)


def _env(options: SelfTestOptions) -> dict[str, str] | None:
    env = options.get("env")
    return dict(env) if env is not None else None


def _decode(stdout: bytes, stderr: bytes, returncode: int) -> SelfTestResult:
    try:
        return msgspec.json.decode(stdout, type=SelfTestResult)
    except msgspec.DecodeError as exc:
        detail = (stderr or stdout).decode(errors="replace").strip()[-2000:]
        raise NetshimCheckError(
            f"nodus-shim-check exited {returncode} without a report: {detail}"
        ) from exc


def self_test(launcher: Sequence[str], **options: Unpack[SelfTestOptions]) -> SelfTestResult:
    """Runs `launcher` with the shim preloaded and reports whether it loaded (G10.3).

    The launcher is the image's own (its python, its torchrun, /bin/sh); it runs with
    stdin and stdout on /dev/null and is killed after `timeout` seconds. Raises
    NetshimCheckError when the check itself cannot report (never for ShimNotLoaded)."""
    command = _command(launcher, options)
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            timeout=_timeout(options) + 15,
            env=_env(options),
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetshimCheckError(f"cannot run {command[0]}: {exc}") from exc
    return _decode(done.stdout, done.stderr, done.returncode)


async def self_test_async(
    launcher: Sequence[str], **options: Unpack[SelfTestOptions]
) -> SelfTestResult:
    """`self_test` for asyncio code (the runner): the check runs as a subprocess."""
    command = await asyncio.to_thread(_command, launcher, options)
    try:
        proc = await asyncio.create_subprocess_exec(
            *command,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=_env(options),
        )
    except OSError as exc:
        raise NetshimCheckError(f"cannot run {command[0]}: {exc}") from exc
    try:
        async with reaped(proc), asyncio.timeout(_timeout(options) + 15):
            stdout, stderr = await proc.communicate()
    except TimeoutError as exc:
        raise NetshimCheckError(f"{command[0]} did not finish in time") from exc
    return _decode(stdout, stderr, proc.returncode if proc.returncode is not None else -1)

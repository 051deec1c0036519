"""The `nodus0` device of a VM member (Direct path), with the member's mesh address: the
kernel's WireGuard where the module exists, configured over netlink with `wg`; else
wireguard-go on a tun device, configured over its UAPI socket (services/agent/wireguard.py
chooses, O5).

One `nodus0` per network namespace: each machine of the lab has its own /var/run/wireguard
(app/netlab), where wireguard-go keeps its control socket.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from pathlib import Path

from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.fleet import WireGuardInfo
from libs.runtime.processes import reaped
from libs.runtime.streams import close_stream
from libs.wg.uapi import (
    GET,
    DeviceConfig,
    DeviceState,
    answer_complete,
    parse_errno,
    parse_get,
    render_set,
)
from libs.wg.wgtool import parse_dump, private_key_input, render_set_argv
from services.agent.direct.wireguard import KERNEL, chosen

log = logging.getLogger("nodus.agent.nodus0")

DEVICE = "nodus0"
SOCKET_DIR = Path("/var/run/wireguard")
WIREGUARD_OVERHEAD = 80  # outer IPv6 (40) + UDP (8) + WireGuard (32): fits either family
START_TIMEOUT = 5.0
UAPI_TIMEOUT = 5.0


def _fail(message: str) -> NodusError:
    return NodusError(ErrorCode.ADDRESS_UNAVAILABLE, f"{DEVICE}: {message}")


async def _run(*argv: str, stdin: bytes | None = None) -> str:
    try:
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    except FileNotFoundError:
        raise _fail(f"{argv[0]} is not installed (deploy/dev/system-deps.sh)") from None
    try:
        async with reaped(process):
            stdout, stderr = await asyncio.wait_for(process.communicate(stdin), UAPI_TIMEOUT)
    except TimeoutError:
        raise _fail(f"{' '.join(argv)} did not answer in {UAPI_TIMEOUT:g} s (killed)") from None
    if process.returncode != 0:
        raise _fail(f"{' '.join(argv)} failed: {stderr.decode(errors='replace').strip()}")
    return stdout.decode(errors="replace")


def path_mtu(interface: str = "eth0") -> int:
    """What fits inside the underlay: its MTU less WireGuard's overhead."""
    try:
        underlay = int(Path(f"/sys/class/net/{interface}/mtu").read_text())
    except (OSError, ValueError):
        underlay = 1500
    return max(1280, underlay - WIREGUARD_OVERHEAD)


def device_exists(name: str) -> bool:
    return os.path.exists(f"/sys/class/net/{name}")  # sysfs: answers at once


class Nodus0:
    """One `nodus0`: `create` it, `configure` peers and keys, read its `state`, `close` it.

    `wireguard`: the implementation (default: this process's choice, wireguard.chosen());
    `control`: `uapi` (our own client, wireguard-go only) or `wg` (wireguard-tools: the kernel's
    netlink, or wireguard-go's socket); the kernel is always configured with `wg`."""

    def __init__(
        self,
        name: str = DEVICE,
        socket_dir: Path = SOCKET_DIR,
        wireguard: WireGuardInfo | None = None,
        control: str = "uapi",
    ) -> None:
        self.name = name
        self.socket = socket_dir / f"{name}.sock"
        self.wireguard = wireguard
        self.control = control
        self._process: asyncio.subprocess.Process | None = None

    @property
    def kernel(self) -> bool:
        return self.wireguard is not None and self.wireguard.implementation == KERNEL

    async def create(self, address: str, prefix_length: int, mtu: int | None = None) -> None:
        if self.wireguard is None:
            self.wireguard = await chosen()
        if self.kernel:
            self.control = "wg"
        await self._remove_leftover()
        if self.kernel:
            await _run("ip", "link", "add", self.name, "type", "wireguard")
        else:
            await self._start_wireguard_go()
        try:
            await _run("ip", "address", "add", f"{address}/{prefix_length}", "dev", self.name)
            await _run("ip", "link", "set", self.name, "mtu", str(mtu or path_mtu()), "up")
        except NodusError:
            await self.close()
            raise
        log.info(
            "%s up at %s/%d (%s %s)",
            self.name,
            address,
            prefix_length,
            self.wireguard.implementation,
            self.wireguard.version,
        )

    async def _remove_leftover(self) -> None:
        if device_exists(self.name):
            # One nodus0 per machine, and it is the agent's: one still here was left by an
            # agent that died (its wireguard-go lives on). Deleting the link ends that
            # wireguard-go, and with it the old epoch's keys and peers.
            log.warning("%s left by an earlier agent: deleting it", self.name)
            await _run("ip", "link", "delete", self.name)
            self.socket.unlink(missing_ok=True)

    async def _start_wireguard_go(self) -> None:
        assert self.wireguard is not None
        binary = self.wireguard.binary or shutil.which("wireguard-go")
        if binary is None:
            raise _fail("wireguard-go is not installed (deploy/dev/system-deps.sh)")
        env = {
            **os.environ,
            "WG_I_PREFER_BUGGY_USERSPACE_TO_POLISHED_KMOD": "1",
            "LOG_LEVEL": "error",
        }
        self._process = await asyncio.create_subprocess_exec(
            binary,
            "-f",
            self.name,
            env=env,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        deadline = asyncio.get_running_loop().time() + START_TIMEOUT
        while not self.socket.exists():
            if self._process.returncode is not None or asyncio.get_running_loop().time() > deadline:
                detail = await self._stderr()
                await self.close()
                raise _fail(f"wireguard-go did not start: {detail or 'no control socket'}")
            await asyncio.sleep(0.02)

    async def _stderr(self) -> str:
        process = self._process
        if process is None or process.stderr is None or process.returncode is None:
            return ""
        return (await process.stderr.read()).decode(errors="replace").strip()[-400:]

    async def _exchange(self, request: bytes) -> bytes:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(str(self.socket)), UAPI_TIMEOUT
            )
        except (OSError, TimeoutError) as error:
            raise _fail(f"its control socket {self.socket} does not answer: {error}") from None
        try:
            writer.write(request)
            data = b""
            while not answer_complete(data):
                chunk = await asyncio.wait_for(reader.read(65536), UAPI_TIMEOUT)
                if not chunk:
                    break
                data += chunk
            return data
        finally:
            await close_stream(writer)

    async def configure(self, config: DeviceConfig) -> None:
        if self.control == "wg":
            current = await self.state() if config.replace_peers else None
            argv = render_set_argv(self.name, config, current)
            await _run(*argv, stdin=private_key_input(config))
            return
        parse_errno(await self._exchange(render_set(config)))

    async def state(self) -> DeviceState:
        if self.control == "wg":
            return parse_dump(await _run("wg", "show", self.name, "dump"))
        return parse_get(await self._exchange(GET))

    async def close(self) -> None:
        """Delete the kernel's device, or stop wireguard-go (the tun device and its routes go
        with it)."""
        if self.kernel:
            if device_exists(self.name):
                try:
                    await _run("ip", "link", "delete", self.name)
                except NodusError as error:  # gone meanwhile
                    log.debug("%s", error)
            return
        process, self._process = self._process, None
        if process is not None and process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), 3.0)
            except TimeoutError:
                process.kill()
                await process.wait()
        self.socket.unlink(missing_ok=True)

"""The `nodus0` device of a VM member (Direct path): Debian's `wireguard-go` on a tun device,
configured over its UAPI socket, with the member's mesh address.

The kernel's WireGuard would do the same job faster, but its configuration goes over netlink
and the module cannot be loaded on the machines this is tested on; wireguard-go is the
implementation here. One `nodus0` per network namespace: each machine of the lab has its own
/var/run/wireguard (app/netlab).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from pathlib import Path

from libs.contracts.errors import ErrorCode, NodusError
from libs.wg.uapi import (
    GET,
    DeviceConfig,
    DeviceState,
    answer_complete,
    parse_errno,
    parse_get,
    render_set,
)

log = logging.getLogger("nodus.agent.nodus0")

DEVICE = "nodus0"
SOCKET_DIR = Path("/var/run/wireguard")
WIREGUARD_OVERHEAD = 80  # outer IPv6 (40) + UDP (8) + WireGuard (32): fits either family
START_TIMEOUT = 5.0
UAPI_TIMEOUT = 5.0


def _fail(message: str) -> NodusError:
    return NodusError(ErrorCode.ADDRESS_UNAVAILABLE, f"{DEVICE}: {message}")


async def _run(*argv: str) -> None:
    process = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    _, stderr = await process.communicate()
    if process.returncode != 0:
        raise _fail(f"{' '.join(argv)} failed: {stderr.decode(errors='replace').strip()}")


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
    """One `nodus0`: `create` it, `configure` peers and keys, read its `state`, `close` it."""

    def __init__(self, name: str = DEVICE, socket_dir: Path = SOCKET_DIR) -> None:
        self.name = name
        self.socket = socket_dir / f"{name}.sock"
        self._process: asyncio.subprocess.Process | None = None

    async def create(self, address: str, prefix_length: int, mtu: int | None = None) -> None:
        binary = shutil.which("wireguard-go")
        if binary is None:
            raise _fail("wireguard-go is not installed (deploy/dev/system-deps.sh)")
        if device_exists(self.name):
            # One nodus0 per machine, and it is the agent's: one still here was left by an
            # agent that died (its wireguard-go lives on). Deleting the link ends that
            # wireguard-go, and with it the old epoch's keys and peers.
            log.warning("%s left by an earlier agent: deleting it", self.name)
            await _run("ip", "link", "delete", self.name)
            self.socket.unlink(missing_ok=True)
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
        try:
            await _run("ip", "address", "add", f"{address}/{prefix_length}", "dev", self.name)
            await _run("ip", "link", "set", self.name, "mtu", str(mtu or path_mtu()), "up")
        except NodusError:
            await self.close()
            raise
        log.info("%s up at %s/%d (wireguard-go)", self.name, address, prefix_length)

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
            writer.close()

    async def configure(self, config: DeviceConfig) -> None:
        parse_errno(await self._exchange(render_set(config)))

    async def state(self) -> DeviceState:
        return parse_get(await self._exchange(GET))

    async def close(self) -> None:
        """Stop wireguard-go; the tun device and its routes go with it."""
        process, self._process = self._process, None
        if process is not None and process.returncode is None:
            process.terminate()
            try:
                await asyncio.wait_for(process.wait(), 3.0)
            except TimeoutError:
                process.kill()
                await process.wait()
        self.socket.unlink(missing_ok=True)

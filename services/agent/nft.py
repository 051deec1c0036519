"""nftables from the agent: one script, one transaction (`nft -f -`), and a clear error."""

from __future__ import annotations

import asyncio

from libs.contracts.errors import ErrorCode, NodusError


async def apply(script: str, what: str) -> None:
    """Apply `script` atomically; NodusError saying `what` failed, and why, otherwise."""
    try:
        process = await asyncio.create_subprocess_exec(
            "nft",
            "-f",
            "-",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
    except FileNotFoundError:
        raise NodusError(
            ErrorCode.ADDRESS_UNAVAILABLE,
            f"{what}: nft is not installed (deploy/dev/system-deps.sh installs nftables)",
        ) from None
    try:
        _, stderr = await process.communicate(script.encode())
    except (RuntimeError, ConnectionError) as error:  # nft ended before reading its script
        await process.wait()
        raise NodusError(
            ErrorCode.ADDRESS_UNAVAILABLE, f"{what}: nft exited {process.returncode}: {error}"
        ) from None
    if process.returncode != 0:
        raise NodusError(
            ErrorCode.ADDRESS_UNAVAILABLE,
            f"{what}: nftables refused: {stderr.decode(errors='replace').strip()}",
        )


async def table_exists(family: str, table: str) -> bool:
    try:
        process = await asyncio.create_subprocess_exec(
            "nft",
            "list",
            "table",
            family,
            table,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
    except FileNotFoundError:
        return False
    return await process.wait() == 0

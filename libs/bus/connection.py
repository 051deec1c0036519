"""The NATS connection every process uses: reconnects forever, readable errors, JetStream."""

from __future__ import annotations

import logging
import os
from typing import Any

import nats
from nats.aio.client import Client
from nats.js import JetStreamContext

from libs.contracts.errors import ErrorCode, NodusError

log = logging.getLogger("nodus.bus")

DEFAULT_URL = "nats://127.0.0.1:4222"


def default_url() -> str:
    return os.environ.get("NODUS_NATS_URL", DEFAULT_URL)


async def connect(
    url: str | None = None,
    name: str = "nodus",
    credentials: str | None = None,
    connect_timeout: float = 2.0,
    initial_attempts: int = 3,
) -> Client:
    """Connect with unbounded reconnects once up; a bus that is down at start is a clear error."""
    url = url or default_url()

    async def on_error(error: Exception) -> None:
        if client:  # before the first connect, the caller gets one clear error instead
            log.warning("bus error: %s", error)

    client: list[Client] = []

    async def on_disconnect() -> None:
        if client and (client[0].is_closed or client[0].is_draining):
            return  # our own close, not an outage
        log.warning("bus disconnected from %s; reconnecting", url)

    async def on_reconnect() -> None:
        log.info("bus reconnected to %s", url)

    options: dict[str, Any] = {
        "servers": [url],
        "name": name,
        "connect_timeout": connect_timeout,
        # Bounded while connecting the first time; unbounded once up (set below).
        "max_reconnect_attempts": initial_attempts,
        "reconnect_time_wait": 0.5,
        "allow_reconnect": True,
        "error_cb": on_error,
        "disconnected_cb": on_disconnect,
        "reconnected_cb": on_reconnect,
    }
    if credentials:
        options["user_credentials"] = credentials
    try:
        nc = await nats.connect(**options)
    except Exception as error:  # nats raises several unrelated types here
        raise NodusError(
            ErrorCode.JOURNAL_UNAVAILABLE,
            f"cannot reach the bus at {url}: {error!s} "
            "(start it with `nodus up`, or pass --nats / set NODUS_NATS_URL)",
        ) from None
    client.append(nc)
    # nats-py reads this option on every reconnect: once up, never give up on the bus.
    nc.options["max_reconnect_attempts"] = -1
    return nc


def jetstream(nc: Client, timeout: float = 5.0) -> JetStreamContext:
    return nc.jetstream(timeout=timeout)

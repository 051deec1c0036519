"""The NATS connection every process uses: reconnects forever, readable errors, JetStream."""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import weakref
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client
from nats.js import JetStreamContext

from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.names import NATS_URL

log = logging.getLogger("nodus.bus")

DEFAULT_URL = NATS_URL


def default_url() -> str:
    return os.environ.get("NODUS_NATS_URL", DEFAULT_URL)


# Where a process finds its own bus credentials: the first set wins (the second is the old name).
CREDENTIAL_VARIABLES = ("NODUS_CREDENTIALS", "NODUS_NATS_CREDS")


def default_credentials() -> str | None:
    """The process's own bus credentials (S1): an NKey seed file (`nats.nk`) or a NATS
    credentials file (`.creds`)."""
    return next((os.environ[v] for v in CREDENTIAL_VARIABLES if os.environ.get(v)), None)


def credential_options(path: str) -> dict[str, Any]:
    """nats-py's options for a credentials file: a seed signs the server's nonce; a .creds
    file carries a user JWT and its seed. Anything else is a clear error, not a refusal
    later."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise NodusError(
            ErrorCode.INVALID, f"bus credentials {path}: {error.strerror or error}"
        ) from None
    if "-----BEGIN NATS USER JWT-----" in text:
        return {"user_credentials": path}
    seed = text.strip()
    if seed.startswith("SU"):
        return {"nkeys_seed_str": seed}
    raise NodusError(
        ErrorCode.INVALID,
        f"bus credentials {path}: neither an NKey user seed (SU...) nor a NATS .creds file",
    )


# How long closing waits for handlers still running (nats-py's drain) before it closes anyway.
DRAIN_SECONDS = 2.0


async def connect(
    url: str | None = None,
    name: str = "nodus",
    credentials: str | None = None,
    inbox_prefix: str | None = None,
    connect_timeout: float = 2.0,
    initial_attempts: int = 3,
) -> Client:
    """Connect with unbounded reconnects once up; a bus that is down at start is a clear error."""
    url = url or default_url()

    refusals: list[str] = []

    async def on_error(error: Exception) -> None:
        if client and "permissions violation" in str(error).lower():
            _REFUSED.setdefault(client[0], _Refusals()).add(str(error))
            log.warning("bus error: %s", error)
        elif client:  # before the first connect, the caller gets one clear error instead
            log.warning("bus error: %s", error)
        elif "authorization" in str(error).lower():
            refusals.append(str(error))

    client: list[Client] = []

    async def on_disconnect() -> None:
        if client and (client[0].is_closed or client[0].is_draining):
            return  # our own close, not an outage
        log.warning("bus disconnected from %s; reconnecting", url)

    async def on_reconnect() -> None:
        log.info("bus reconnected to %s", url)

    options: dict[str, Any] = {
        "servers": [u.strip() for u in url.split(",") if u.strip()],  # a cluster: every server
        "name": name,
        "connect_timeout": connect_timeout,
        # Bounded while connecting the first time; unbounded once up (set below).
        "max_reconnect_attempts": initial_attempts,
        "reconnect_time_wait": 0.5,
        "allow_reconnect": True,
        "error_cb": on_error,
        "disconnected_cb": on_disconnect,
        "reconnected_cb": on_reconnect,
        # nats-py bounds its own drain: cancelling a drain from outside leaves its gather of
        # the subscriptions' drains unretrieved (an asyncio error in the daemon's log).
        "drain_timeout": DRAIN_SECONDS,
    }
    credentials = credentials or default_credentials()
    if credentials:
        options.update(credential_options(credentials))
    if inbox_prefix:  # a confined agent receives replies only on its own inbox (S1)
        options["inbox_prefix"] = inbox_prefix
    ca = os.environ.get("NODUS_NATS_CA")
    if ca:  # a bus with TLS on (`nodus bus init`): trust its own authority
        options["tls"] = ssl.create_default_context(cafile=ca)
    try:
        # Bounded as a whole: nats-py can wait forever on a TLS handshake it failed.
        bound = (connect_timeout + 1.0) * initial_attempts + 2.0
        nc = await asyncio.wait_for(nats.connect(**options), bound)
    except Exception as error:  # nats raises several unrelated types here
        if _refused(error, refusals):
            raise NodusError(
                ErrorCode.UNAUTHORIZED,
                f"the bus at {url} refused these credentials ({credentials or 'none'}): "
                f"{refusals[-1]} (pass --credentials or set NODUS_CREDENTIALS)",
            ) from None
        if isinstance(error, TimeoutError) and "tls://" in url:
            error = TimeoutError(
                "no handshake: on a TLS bus, does NODUS_NATS_CA name its authority?"
            )
        raise NodusError(
            ErrorCode.JOURNAL_UNAVAILABLE,
            f"cannot reach the bus at {url}: {error!s} "
            "(start it with `nodus up`, or pass --nats / set NODUS_NATS_URL)",
        ) from None
    client.append(nc)
    # nats-py reads this option on every reconnect: once up, never give up on the bus.
    nc.options["max_reconnect_attempts"] = -1
    return nc


@dataclass
class _Refusals:
    """The server's permission refusals of one connection: how many, and the last few."""

    count: int = 0
    last: deque[str] = field(default_factory=lambda: deque(maxlen=10))

    def add(self, refusal: str) -> None:
        self.count += 1
        self.last.append(refusal)


# Per connection: a refused publish is otherwise only a request that times out.
_REFUSED: weakref.WeakKeyDictionary[Client, _Refusals] = weakref.WeakKeyDictionary()


def refusal_count(nc: Client) -> int:
    """How many publishes the server refused this connection (a refused act is no outage)."""
    found = _REFUSED.get(nc)
    return found.count if found else 0


def refusal_of(nc: Client, subject: str) -> str | None:
    """The server's refusal of this connection's publish to `subject`, if it refused one."""
    found = _REFUSED.get(nc)
    for refusal in reversed(found.last if found else ()):
        if f'"{subject.lower()}"' in refusal.lower():
            return refusal
    return None


def _refused(error: Exception, refusals: list[str]) -> bool:
    return bool(refusals) or "authorization" in str(error).lower()


def jetstream(nc: Client, timeout: float = 5.0) -> JetStreamContext:
    return nc.jetstream(timeout=timeout)

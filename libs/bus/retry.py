"""Riding out the loss of one NATS server (issue 14): which failures of a JetStream call are
transient (the connection moves to another server, a stream elects a new leader), and a
bounded retry around a call that is safe to repeat.

A write whose answer was lost may have landed. Callers make each retry safe: a put writes the
same value again, a stream publish carries a `Nats-Msg-Id` the stream deduplicates, and a
compare-and-set that finds the key moved checks whether it moved to its own value
(`libs.bus.kv`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors
import nats.js.errors
from nats.aio.client import Client
from prometheus_client import Counter

from libs.bus.connection import refusal_count

log = logging.getLogger("nodus.bus")

T = TypeVar("T")

# Long enough for a reconnect (0.5 s a try) and a stream leader election (a few seconds).
RETRY_SECONDS = 20.0
PAUSES = (0.05, 0.1, 0.2, 0.5, 1.0)  # then 1 s until the deadline

# JetStream's "temporarily unavailable" and "no leader" answers, and "no suitable peers for
# placement, peer offline" (10005: a stream made while a server of the cluster restarts; on a
# cluster too small for the replicas it stays, and the deadline raises it).
_TRANSIENT_API_CODES = {10005, 10008, 10023}

RETRIES = Counter(
    "nodus_bus_retries_total",
    "JetStream calls tried again after a transient failure (a server lost, a leader elected)",
    ["what"],
)


class Retried:
    """An `on_retry` that remembers it was called: the first try may have landed."""

    def __init__(self) -> None:
        self.happened = False

    def __call__(self) -> None:
        self.happened = True

    def __bool__(self) -> bool:
        return self.happened


def transient(error: BaseException) -> bool:
    """Would the same call, made again in a moment, likely succeed?"""
    if isinstance(
        error,
        nats.errors.TimeoutError
        | nats.errors.NoRespondersError
        | nats.errors.ConnectionReconnectingError
        | nats.errors.StaleConnectionError
        | nats.js.errors.ServiceUnavailableError
        | nats.js.errors.NoStreamResponseError
        | TimeoutError,
    ):
        return True
    if isinstance(error, nats.js.errors.APIError):  # some subclasses lack the fields
        code = getattr(error, "err_code", None) or 0
        return code in _TRANSIENT_API_CODES or getattr(error, "code", None) == 503
    return False


def _nobody_answered(error: BaseException) -> bool:
    """No responders, as nats-py says it for a core request and for a JetStream API one (a
    503 with no JetStream error code: no server answered, none refused)."""
    if isinstance(error, nats.js.errors.ServiceUnavailableError):
        return getattr(error, "err_code", None) is None
    return isinstance(error, nats.errors.NoRespondersError)


def _cancel_was_swallowed() -> bool:
    """Was this task cancelled while in the call? nats-py answers a cancelled request with its
    TimeoutError, which looks transient: retried, the cancellation is lost and the caller's
    `wait_for` waits until the retries end (a runner's readiness wait never ended so)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


async def retrying(
    call: Callable[[], Awaitable[T]],
    what: str,
    nc: Client | None = None,
    deadline_seconds: float = RETRY_SECONDS,
    on_retry: Callable[[], None] | None = None,
    no_responders_seconds: float | None = None,
) -> T:
    """`call()` until it succeeds, fails for good, or the deadline passes (the last error is
    raised). A timeout after the server refused one of `nc`'s publishes is a refusal (S1), not
    an outage: raised at once. `on_retry` runs before each retry: the caller notes its first
    try may have landed. `no_responders_seconds` bounds how long nobody answering is
    transient: a JetStream API request that nobody answers that long reached a server
    without JetStream (every server with it answers the API, leader or not)."""
    deadline = time.monotonic() + deadline_seconds
    unanswered_since: float | None = None
    refused = refusal_count(nc) if nc is not None else 0
    attempt = 0
    while True:
        try:
            return await call()
        except Exception as error:
            if _cancel_was_swallowed():
                raise asyncio.CancelledError() from error
            if not transient(error) or time.monotonic() >= deadline:
                raise
            if _nobody_answered(error) and no_responders_seconds:
                unanswered_since = unanswered_since or time.monotonic()
                if time.monotonic() - unanswered_since >= no_responders_seconds:
                    raise
            else:
                unanswered_since = None
            if nc is not None and refusal_count(nc) > refused:
                raise
            pause = PAUSES[attempt] if attempt < len(PAUSES) else PAUSES[-1]
            attempt += 1
            RETRIES.labels(what).inc()
            if attempt == 1:
                log.info("%s: %r; trying again (the bus is failing over)", what, error)
            await asyncio.sleep(pause)
            if on_retry is not None:
                on_retry()

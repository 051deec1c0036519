"""A bounded retry must not outlive its caller: a call cancelled mid-way ends the retries."""

from __future__ import annotations

import asyncio
import time

import nats.errors
import pytest

from libs.bus.retry import retrying


async def test_a_cancellation_turned_into_a_timeout_is_not_retried() -> None:
    calls = 0

    async def request() -> None:  # a request that reports its cancellation as a timeout
        nonlocal calls
        calls += 1
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            raise nats.errors.TimeoutError from None

    started = time.monotonic()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(retrying(request, "test request"), 0.2)
    assert calls == 1
    assert time.monotonic() - started < 5  # not the 20 s of retries


async def test_a_transient_failure_is_still_retried() -> None:
    calls = 0

    async def request() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise nats.errors.TimeoutError
        return "answered"

    assert await retrying(request, "test request") == "answered"
    assert calls == 3

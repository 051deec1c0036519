"""JetStream acknowledgements read as nats-py reads them: a compare-and-set missed is
KeyWrongLastSequenceError whichever of its two codes the server used (a clustered stream
answers 10164, a single server 10071), other errors are nats-py's API errors."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

import nats.js.errors
import pytest

from libs.bus.acks import Acks


@dataclass
class FakeMsg:
    subject: str
    data: bytes
    headers: dict[str, str] | None = None


class FakeConnection:
    """Answers every publish with `answer`, as a stream would on the reply subject."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self.callback: Callable[[Any], Awaitable[None]] | None = None

    def new_inbox(self) -> str:
        return "_INBOX.test"

    async def subscribe(self, subject: str, cb: Callable[[Any], Awaitable[None]]) -> None:
        self.callback = cb

    async def publish(self, subject: str, data: bytes, reply: str, headers: Any) -> None:
        assert self.callback is not None
        callback, answer = self.callback, self.answer
        asyncio.get_running_loop().call_soon(
            lambda: asyncio.ensure_future(callback(FakeMsg(reply, answer)))
        )


def acks(answer: bytes) -> Acks:
    return Acks(cast(Any, FakeConnection(answer)))


@pytest.mark.parametrize("code", [10071, 10164])
async def test_a_missed_compare_and_set_is_a_wrong_last_sequence(code: int) -> None:
    error = b'{"error":{"code":400,"err_code":%d,"description":"wrong last sequence"}}' % code
    with pytest.raises(nats.js.errors.KeyWrongLastSequenceError):
        await acks(error).publish("$KV.b.k", b"v")


async def test_another_error_is_nats_pys_api_error() -> None:
    error = b'{"error":{"code":503,"err_code":10008,"description":"unavailable"}}'
    with pytest.raises(nats.js.errors.ServiceUnavailableError):
        await acks(error).publish("$KV.b.k", b"v")


async def test_a_stored_write_says_where() -> None:
    ack = await acks(b'{"stream":"KV_b","seq":42}').publish("$KV.b.k", b"v")
    assert (ack.stream, ack.seq) == ("KV_b", 42)

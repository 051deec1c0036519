"""JetStream writes acknowledged on one wildcard inbox per connection.

nats-py's `JetStreamContext.publish` pays, per write, a random token from the OS, a future
with a done-callback, `asyncio.wait_for`, a `json.loads` and a dataclass for the ack; the placer
writes about fourteen records a decision, so that was a third of its time. Here a write is a
counter for its token, one future, and an ack decoded by msgspec: half the CPU, measured by
`tests/bench/placement.py`. Failures are raised as nats-py's, so `retrying` and the callers'
compare-and-set handling see what they saw before."""

from __future__ import annotations

import asyncio
import itertools

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from libs.contracts.jetstream import PubAck

# A compare-and-set missed (Nats-Expected-Last-Subject-Sequence): 10071 names the sequence,
# 10164 does not (a clustered stream answers with it).
WRONG_LAST_SEQUENCE = frozenset({10071, 10164})
NO_RESPONDERS = "503"  # no stream listens on the subject


_DECODE_ACK = msgspec.json.Decoder(PubAck)


class Acks:
    """Publishes into streams on one connection and awaits each acknowledgement."""

    def __init__(self, nc: Client, timeout: float = 5.0) -> None:
        self._nc = nc
        self._timeout = timeout
        self._prefix = ""
        self._subscribing = asyncio.Lock()
        self._waiting: dict[str, asyncio.Future[Msg]] = {}
        self._tokens = itertools.count(1)

    async def publish(
        self, subject: str, data: bytes, headers: dict[str, str] | None = None
    ) -> PubAck:
        """Store `data` on `subject`; the stream's acknowledgement, or nats-py's error."""
        if not self._prefix:
            await self._subscribe()
        token = str(next(self._tokens))
        answer: asyncio.Future[Msg] = asyncio.get_running_loop().create_future()
        self._waiting[token] = answer
        try:
            await self._nc.publish(subject, data, reply=self._prefix + token, headers=headers)
            async with asyncio.timeout(self._timeout):
                msg = await answer
        except TimeoutError:
            raise nats.errors.TimeoutError from None
        finally:
            self._waiting.pop(token, None)
        if not msg.data and msg.headers and msg.headers.get("Status") == NO_RESPONDERS:
            raise nats.js.errors.NoStreamResponseError
        ack = _DECODE_ACK.decode(msg.data)
        if ack.error is not None:
            if ack.error.err_code in WRONG_LAST_SEQUENCE:
                raise nats.js.errors.KeyWrongLastSequenceError(ack.error.description)
            nats.js.errors.APIError.from_error(msgspec.structs.asdict(ack.error))  # raises
        return ack

    async def _subscribe(self) -> None:
        """One subscription for every answer, made once."""
        async with self._subscribing:
            if not self._prefix:
                prefix = self._nc.new_inbox() + "."
                await self._nc.subscribe(prefix + "*", cb=self._answered)
                self._prefix = prefix

    async def _answered(self, msg: Msg) -> None:
        answer = self._waiting.get(msg.subject[len(self._prefix) :])
        if answer is not None and not answer.done():
            answer.set_result(msg)

"""Many JetStream writes sent at once, their acknowledgements awaited together.

A placement writes a record per member (leases, join keys) and a few more. Written one by one,
each awaited, a decision cost a round trip per record, and each write cost its writer a future,
a timeout, a retry wrapper and a task switch (about 80 us of CPU: the placer's largest cost).
Here a batch leaves in one go: each answer fills its slot, and the batch is done when the last
is in (one round trip, one timeout, a counter per write).

Outcomes are `Bucket`'s: a put's revision; a create's or an update's revision, or None when the
compare-and-set missed. A write whose answer is lost or transient (a server failing over) is
settled the careful way, as `Bucket` does for one write: read back, and if it did not land,
written again through `Bucket`'s retrying methods (a stream publish carries a `Nats-Msg-Id`,
which the stream deduplicates, and is simply sent again)."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg

from libs.bus.acks import NO_RESPONDERS, WRONG_LAST_SEQUENCE
from libs.bus.kv import EXPECTED_LAST_SUBJECT_SEQUENCE, Bucket
from libs.bus.retry import retrying, transient
from libs.contracts.base import encode
from libs.contracts.jetstream import PubAck

if TYPE_CHECKING:
    from libs.bus.bus import Bus

T = TypeVar("T", bound=msgspec.Struct)

_DECODE_ACK = msgspec.json.Decoder(PubAck)
KV_OPERATION = "KV-Operation"


class _Unanswered(Exception):
    """No answer within the batch's time: settled like a lost answer."""


class _Write:
    """One write of a batch, and what settles it the careful way if its answer is lost."""

    __slots__ = ("bucket", "data", "headers", "key", "kind", "result", "revision", "subject")

    def __init__(
        self,
        kind: str,  # put, create, update, delete, publish
        subject: str,
        data: bytes,
        headers: dict[str, str] | None,
        bucket: Bucket[Any] | None = None,
        key: str = "",
        revision: int = 0,
    ) -> None:
        self.kind = kind
        self.subject = subject
        self.data = data
        self.headers = headers
        self.bucket = bucket
        self.key = key
        self.revision = revision
        self.result: int | BaseException | None = None


@dataclass(slots=True)
class _InFlight:
    writes: list[_Write]
    left: int
    done: asyncio.Future[None]
    tokens: list[str] = field(default_factory=list)


class Batches:
    """One bus connection's batch writer: one inbox for every answer, made on first use."""

    def __init__(self, bus: Bus, timeout: float = 5.0) -> None:
        self._nc: Client = bus.nc
        self._acks = bus.acks  # a lost answer's stream publish goes again through it
        self._timeout = timeout
        self._prefix = ""
        self._subscribing = asyncio.Lock()
        self._waiting: dict[str, tuple[_InFlight, int]] = {}
        self._tokens = itertools.count(1)

    def batch(self) -> Batch:
        return Batch(self)

    async def _send(self, writes: list[_Write]) -> None:
        if not writes:
            return
        if not self._prefix:
            await self._subscribe()
        flight = _InFlight(writes, len(writes), asyncio.get_running_loop().create_future())
        for index, write in enumerate(writes):
            token = str(next(self._tokens))
            flight.tokens.append(token)
            self._waiting[token] = (flight, index)
            try:
                await self._nc.publish(
                    write.subject, write.data, reply=self._prefix + token, headers=write.headers
                )
            except Exception as error:  # not sent (reconnecting, closed): settled below
                self._waiting.pop(token, None)
                write.result = error
                flight.left -= 1
        try:
            if flight.left:
                async with asyncio.timeout(self._timeout):
                    await flight.done
        except TimeoutError:
            for token in flight.tokens:
                found = self._waiting.get(token)
                if found is not None:
                    writes[found[1]].result = _Unanswered()
        finally:
            for token in flight.tokens:
                self._waiting.pop(token, None)

    async def _subscribe(self) -> None:
        async with self._subscribing:
            if not self._prefix:
                prefix = self._nc.new_inbox() + "."
                await self._nc.subscribe(prefix + "*", cb=self._answered)
                self._prefix = prefix

    async def _answered(self, msg: Msg) -> None:
        found = self._waiting.pop(msg.subject[len(self._prefix) :], None)
        if found is None:
            return  # answered after its batch gave up on it: settled already
        flight, index = found
        flight.writes[index].result = _outcome(msg)
        flight.left -= 1
        if flight.left == 0 and not flight.done.done():
            flight.done.set_result(None)


def _outcome(msg: Msg) -> int | BaseException | None:
    """A stream's answer: the stored revision, None for a compare-and-set missed, or the
    error nats-py would have raised for it."""
    if not msg.data and msg.headers and msg.headers.get("Status") == NO_RESPONDERS:
        return nats.js.errors.NoStreamResponseError()
    try:
        ack = _DECODE_ACK.decode(msg.data)
    except msgspec.DecodeError as error:
        return error
    if ack.error is None:
        return ack.seq
    if ack.error.err_code in WRONG_LAST_SEQUENCE:
        return None
    try:
        nats.js.errors.APIError.from_error(msgspec.structs.asdict(ack.error))  # raises
    except nats.js.errors.Error as error:
        return error
    return nats.js.errors.APIError(description=ack.error.description)


class Batch:
    """Writes gathered, then sent together by `send`; each `add` returns its slot's index."""

    def __init__(self, batches: Batches) -> None:
        self._batches = batches
        self._writes: list[_Write] = []

    def __len__(self) -> int:
        return len(self._writes)

    def put(self, bucket: Bucket[T], key: str, value: T) -> int:
        return self.put_encoded(bucket, key, encode(value))

    def put_encoded(self, bucket: Bucket[T], key: str, data: bytes) -> int:
        """A put of a value already encoded: one record written under many keys is encoded
        once."""
        return self._add(_Write("put", bucket._subjects + key, data, None, bucket, key))

    def create(self, bucket: Bucket[T], key: str, value: T, after: int = 0) -> int:
        """Write only if the key holds nothing. `after`: the key's last revision when known
        to be a delete (a watch saw it); a stale one only costs the careful path."""
        return self.create_encoded(bucket, key, encode(value), after)

    def create_encoded(self, bucket: Bucket[T], key: str, data: bytes, after: int = 0) -> int:
        """A create of a value already encoded (see `put_encoded`)."""
        headers = {EXPECTED_LAST_SUBJECT_SEQUENCE: str(after)}
        return self._add(
            _Write("create", bucket._subjects + key, data, headers, bucket, key, after)
        )

    def update(self, bucket: Bucket[T], key: str, value: T, revision: int) -> int:
        headers = {EXPECTED_LAST_SUBJECT_SEQUENCE: str(revision)}
        return self._add(
            _Write("update", bucket._subjects + key, encode(value), headers, bucket, key, revision)
        )

    def delete(self, bucket: Bucket[T], key: str, revision: int) -> int:
        """Delete if the key is still at `revision` (outcome: the marker's revision, or None)."""
        headers = {KV_OPERATION: "DEL", EXPECTED_LAST_SUBJECT_SEQUENCE: str(revision)}
        return self._add(
            _Write("delete", bucket._subjects + key, b"", headers, bucket, key, revision)
        )

    def publish(self, subject: str, body: msgspec.Struct, msg_id: str) -> int:
        """Into a stream, deduplicated by `msg_id`: sent again when its answer is lost."""
        return self._add(_Write("publish", subject, encode(body), {"Nats-Msg-Id": msg_id}))

    def _add(self, write: _Write) -> int:
        self._writes.append(write)
        return len(self._writes) - 1

    async def send(self) -> list[int | None]:
        """Send every write, await every answer; each slot's outcome. A write that failed for
        good raises (after every other write was settled)."""
        results: list[int | None] = []
        for outcome in await self.outcomes():
            if isinstance(outcome, BaseException):
                raise outcome
            results.append(outcome)
        return results

    async def outcomes(self) -> list[int | BaseException | None]:
        """As `send`, a write that failed for good given as its error instead of raised."""
        writes, self._writes = self._writes, []
        await self._batches._send(writes)
        again = [
            w
            for w in writes
            if isinstance(w.result, BaseException) or (w.result is None and w.kind == "create")
        ]
        if again:
            settled = await asyncio.gather(
                *(self._settle_one(w) for w in again), return_exceptions=True
            )
            for write, outcome in zip(again, settled, strict=True):
                write.result = outcome
        return [write.result for write in writes]

    async def _settle_one(self, write: _Write) -> int | None:
        error = write.result
        if error is None:  # a create that missed: maybe on a delete marker, asked as `Bucket` does
            assert write.bucket is not None
            return await write.bucket.create(write.key, write.bucket._decode(write.key, write.data))
        if isinstance(error, BaseException) and not (
            isinstance(error, _Unanswered) or transient(error)
        ):
            raise error
        return await self._settle(write)

    async def _settle(self, write: _Write) -> int | None:
        """A write whose answer was lost: a stream publish goes again (the stream drops a
        duplicate); a KV write landed if the key holds its bytes, else it is written again the
        way `Bucket` writes one (its retries ride out a failover)."""
        if write.kind == "publish":
            acks, nc, subject = self._batches._acks, self._batches._nc, write.subject
            ack = await retrying(
                lambda: acks.publish(subject, write.data, write.headers),
                f"publish {subject}",
                nc,
            )
            return int(ack.seq)
        bucket, key = write.bucket, write.key
        assert bucket is not None
        if write.kind == "delete":
            return 0 if await bucket.delete(key, write.revision) else None
        if write.kind != "put":
            entry = await bucket._entry(key)
            if entry is not None and entry.value == write.data:
                return int(entry.revision or 0)
        value = bucket._decode(key, write.data)
        if write.kind == "put":
            return await bucket.put(key, value)
        if write.kind == "create":
            return await bucket.create(key, value)
        return await bucket.update(key, value, write.revision)


class Coalescing:
    """Writes asked for one at a time by many callers (request handlers), sent together: those
    asked in one pass of the event loop leave as one batch, and each caller awaits its own."""

    def __init__(self, batches: Batches) -> None:
        self._batches = batches
        self._batch: Batch | None = None
        self._waiting: list[asyncio.Future[int | None]] = []
        self._sending: set[asyncio.Task[None]] = set()

    async def create(self, bucket: Bucket[T], key: str, value: T) -> int | None:
        """As `Bucket.create`: the revision, or None when the key holds something."""
        if self._batch is None:
            self._batch = self._batches.batch()
            asyncio.get_running_loop().call_soon(self._send)
        self._batch.create(bucket, key, value)
        answer: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()
        self._waiting.append(answer)
        return await answer

    def _send(self) -> None:
        batch, waiting = self._batch, self._waiting
        self._batch, self._waiting = None, []
        if batch is not None:
            task = asyncio.get_running_loop().create_task(self._answer(batch, waiting))
            self._sending.add(task)  # held until done: the loop keeps weak references only
            task.add_done_callback(self._sending.discard)

    @staticmethod
    async def _answer(batch: Batch, waiting: list[asyncio.Future[int | None]]) -> None:
        try:
            outcomes = await batch.outcomes()
        except asyncio.CancelledError:
            for answer in waiting:
                answer.cancel()
            raise
        except Exception as error:  # every caller hears it
            for answer in waiting:
                if not answer.done():
                    answer.set_exception(error)
            return
        for answer, outcome in zip(waiting, outcomes, strict=True):
            if answer.done():  # its caller gave up (cancelled)
                continue
            if isinstance(outcome, BaseException):
                answer.set_exception(outcome)
            else:
                answer.set_result(outcome)

"""Typed JetStream KV: get, create, compare-and-set updates on revisions, snapshots, watches."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec
import nats.errors
from nats.js.api import ConsumerConfig
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue
from nats.nuid import NUID
from prometheus_client import Counter

from libs.bus.acks import Acks
from libs.bus.retry import Retried, retrying
from libs.contracts.base import decode, encode
from libs.contracts.errors import ErrorCode, NodusError

T = TypeVar("T", bound=msgspec.Struct)

log = logging.getLogger("nodus.bus")

MALFORMED_RECORDS = Counter(
    "nodus_bus_malformed_records_total",
    "KV records skipped because they did not decode (S3: counted, never fatal)",
    ["bucket"],
)

KV_DEL = "DEL"
KV_PURGE = "PURGE"
EXPECTED_LAST_SUBJECT_SEQUENCE = "Nats-Expected-Last-Subject-Sequence"
# A watch's consumer lives on one server (an ordered consumer has one replica). When that server
# dies, nats-py makes the consumer again after two heartbeats are missed, and tries again each
# two more: at its default of 5 s a watch saw nothing for 10-20 s (placers missed released
# leases, runners missed joins). Idle heartbeats are a few bytes a second per watch.
WATCH_HEARTBEAT_SECONDS = 1.0
# Making a lost watch's consumer again: each try bounded, the next at once, for so long. A try
# sent while the cluster has no JetStream metadata leader (the dead server held it) is never
# answered: 1-s tries see the new leader within about a second of its election (2-s ones left a
# watch blind for 10.0 s in CI).
RECREATE_TRY_SECONDS = 1.0
RECREATE_PAUSE_SECONDS = 0.1
RECREATE_SECONDS = 30.0
# How long a confined user waits for a direct read's answer (then it is retried).
DIRECT_READ_SECONDS = 5.0


class _NamedConsumers:
    """JetStream as nats-py's KeyValue sees it, except that a watch's consumer has a name.

    A consumer with a name is created on `$JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>`,
    where NATS permissions can check the filter (S1); nats-py creates an unnamed one on a
    subject that names no filter. An ordered consumer that lost a message is made again:
    under a new name, since the old one still exists and cannot change where it starts."""

    def __init__(self, js: Any) -> None:
        self._js = js

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._js, name)
        if callable(found):  # a method: kept, so the next call skips this lookup
            setattr(self, name, found)
        return found

    async def subscribe(self, subject: str, **options: Any) -> Any:
        options["config"] = ConsumerConfig(name=_consumer_name())
        options.setdefault("idle_heartbeat", WATCH_HEARTBEAT_SECONDS)
        subscription = await self._js.subscribe(subject, **options)
        # nats-py keeps an ordered consumer's state on the inner subscription.
        inner = getattr(subscription, "_sub", subscription)
        jsi = getattr(inner, "_jsi", None)
        if jsi is not None and hasattr(jsi, "recreate_consumer"):
            resets = [0]

            async def recreate_under_new_name() -> None:
                """nats-py's own tries once, with the context's 5-s timeout, and on a failure
                waits for two more missed heartbeats: a watch whose server died during an
                election saw nothing for 10 s (CI). One name per reset, so that a try whose
                answer was lost and the next make one consumer; tried again at once until
                made, a newer reset takes over, or RECREATE_SECONDS pass."""
                resets[0] += 1
                reset = resets[0]
                jsi._ccreq.name = _consumer_name()
                loop = asyncio.get_running_loop()
                deadline = loop.time() + RECREATE_SECONDS
                while reset == resets[0] and not jsi._conn.is_closed:
                    try:
                        info = await jsi._js._jsm.add_consumer(
                            jsi._stream, config=jsi._ccreq, timeout=RECREATE_TRY_SECONDS
                        )
                    except Exception as error:
                        if loop.time() >= deadline:
                            await jsi._conn._error_cb(error)
                            return
                        await asyncio.sleep(RECREATE_PAUSE_SECONDS)
                        continue
                    jsi._psub._consumer = info.name
                    return

            jsi.recreate_consumer = recreate_under_new_name
        return subscription


_NAMES = NUID()


def _consumer_name() -> str:
    return _NAMES.next().decode()


def named_watches(kv: KeyValue) -> KeyValue:
    """The same bucket, its watches on named consumers (see _NamedConsumers)."""
    if not isinstance(kv._js, _NamedConsumers):
        kv._js = _NamedConsumers(kv._js)  # type: ignore[assignment]
    return kv


@dataclass(frozen=True, slots=True)
class Versioned(Generic[T]):
    key: str
    value: T
    revision: int


@dataclass(frozen=True, slots=True)
class Change(Generic[T]):
    """One change seen by a watcher, in bucket order. `value` is None for a delete."""

    key: str
    value: T | None
    revision: int


class Bucket(Generic[T]):
    """One KV bucket holding records of one type."""

    def __init__(
        self, kv: KeyValue, kind: type[T], name: str, acks: Acks, confined: bool = False
    ) -> None:
        self._kv = kv
        self._confined = confined  # see Bus.confined
        self._nc: Any = kv._js._nc  # its connection: a refused publish is not retried
        self._acks = acks  # its connection's writes: see libs.bus.acks
        self._subjects: str = kv._pre  # "$KV.<bucket>." (or a domain's prefix)
        self.kind = kind
        self.name = name

    def subject(self, key: str) -> str:
        """Where a write of `key` goes (what a user's permissions must allow)."""
        return self._subjects + key

    async def get(self, key: str) -> Versioned[T] | None:
        entry = await self._entry(key)
        if entry is None:
            return None
        return Versioned(key, self._decode(key, entry.value), entry.revision or 0)

    async def _entry(self, key: str) -> Any:
        """The key's live entry, or None. A direct read is answered by any replica; one just
        created or elected may not answer for a moment, which `retrying` rides out."""
        try:
            entry = await retrying(lambda: self._kv.get(key), f"get {self.name}", self._nc)
        except KeyNotFoundError:
            return None
        if entry.value is None or entry.operation in (KV_DEL, KV_PURGE):
            return None
        return entry

    async def put(self, key: str, value: T) -> int:
        data = encode(value)
        subject = self._subjects + key
        ack = await retrying(
            lambda: self._acks.publish(subject, data), f"put {self.name}", self._nc
        )
        return ack.seq

    async def create(self, key: str, value: T) -> int | None:
        """Write only if the key holds nothing; None when somebody else holds it."""
        return await self._compare_and_set(key, encode(value), None, "create")

    async def update(self, key: str, value: T, revision: int) -> int | None:
        """Compare-and-set: write only if the key is still at `revision`; None if it moved on."""
        return await self._compare_and_set(key, encode(value), revision, "update")

    async def _compare_and_set(
        self, key: str, data: bytes, revision: int | None, what: str
    ) -> int | None:
        """A create (revision None) or an update, exactly once: when an answer is lost and
        the retry finds the key moved, it moved to this write if it holds these bytes."""
        retried = Retried()

        async def write() -> int:
            if revision is None:
                return await self._create(key, data)
            return await self._write(key, data, revision)

        try:
            return await retrying(write, f"{what} {self.name}", self._nc, on_retry=retried)
        except KeyWrongLastSequenceError:
            if not retried:
                return None
            entry = await self._entry(key)
            return int(entry.revision or 0) if entry is not None and entry.value == data else None

    async def _write(self, key: str, data: bytes, expected: int) -> int:
        """A write on the key's last revision being `expected` (0: the key never held one)."""
        headers = {EXPECTED_LAST_SUBJECT_SEQUENCE: str(expected)}
        return (await self._acks.publish(self._subjects + key, data, headers)).seq

    async def _create(self, key: str, data: bytes) -> int:
        """A write on an empty key: one never written, or deleted (its last revision is then
        the delete marker's, which is read, as nats-py's create does)."""
        try:
            return await self._write(key, data, 0)
        except KeyWrongLastSequenceError:
            try:
                await self._kv.get(key)
            except KeyNotFoundError as error:
                marker = getattr(error, "entry", None)
                if marker is not None and marker.revision:
                    return await self._write(key, data, marker.revision)
            raise

    async def delete(self, key: str, revision: int | None = None) -> bool:
        """Delete (compare-and-set when `revision` is given); False if the key moved on. After
        a lost answer, a key found deleted counts as deleted."""
        retried = Retried()
        try:
            await retrying(
                lambda: self._kv.delete(key, last=revision),
                f"delete {self.name}",
                self._nc,
                on_retry=retried,
            )
        except Exception as error:  # a CAS miss: KeyWrongLastSequenceError, or an APIError
            miss = isinstance(error, KeyWrongLastSequenceError) or getattr(
                error, "err_code", None
            ) in (10071, 10164)
            if not miss:
                raise
            return bool(retried) and await self._entry(key) is None
        return True

    async def mutate(
        self, key: str, change: Callable[[T | None], T | None], attempts: int = 50
    ) -> Versioned[T] | None:
        """Read, change, compare-and-set, retry on a race; `change` returning None stops."""
        for _ in range(attempts):
            current = await self.get(key)
            new = change(current.value if current else None)
            if new is None:
                return None
            if current is None:
                revision = await self.create(key, new)
            else:
                revision = await self.update(key, new, current.revision)
            if revision is not None:
                return Versioned(key, new, revision)
        raise NodusError(ErrorCode.CONFLICT, f"{self.name}/{key}: too many concurrent writers")

    async def _matches_anything(self, keys: str) -> bool:
        """Does any key (live or deleted) match? nats-py's end-of-initial-values marker can
        arrive before an in-flight first value, so emptiness is asked of the stream instead.
        A confined user may not ask the stream (its answer may list every key's name): it
        reads the last record of the keys it may read, one direct read that names them in
        its subject (which its permissions allow), answered "not found" when none match."""
        if self._confined:
            subject = f"$JS.API.DIRECT.GET.KV_{self.name}.{self.subject(keys)}"
            last = await retrying(
                lambda: self._nc.request(subject, b"", timeout=DIRECT_READ_SECONDS),
                f"look into {self.name}",
                self._nc,
            )
            status = (last.headers or {}).get("Status")
            if status == "404":
                return False
            if status is not None:  # another answer than a record (a 503 is retried above)
                raise NodusError(
                    ErrorCode.JOURNAL_UNAVAILABLE,
                    f"bucket {self.name}: reading {keys} answered {status} "
                    f"{(last.headers or {}).get('Description', '')}",
                )
            return True
        info = await retrying(
            lambda: self._kv._js.stream_info(
                f"KV_{self.name}", subjects_filter=f"$KV.{self.name}.{keys}"
            ),
            f"count {self.name}",
            self._nc,
        )
        return bool(info.state.subjects)

    async def snapshot(self, keys: str = ">") -> dict[str, Versioned[T]]:
        """Every live key matching `keys`, read in one ordered pass."""
        result: dict[str, Versioned[T]] = {}
        if not await self._matches_anything(keys):
            return result
        # A short inactivity threshold: the server drops this one-shot consumer soon after.
        watcher = await retrying(
            lambda: self._kv.watch(keys, inactive_threshold=5.0), f"read {self.name}", self._nc
        )
        try:
            while True:
                entry = await watcher.updates(timeout=5.0)
                if entry is None:
                    continue  # see _matches_anything: the last value tells instead
                if entry.operation in (KV_DEL, KV_PURGE) or not entry.value:
                    result.pop(entry.key, None)
                else:
                    value = self._decode_or_skip(entry.key, entry.value)
                    if value is not None:
                        result[entry.key] = Versioned(entry.key, value, entry.revision or 0)
                if entry.delta == 0:
                    break
        except nats.errors.TimeoutError:
            log.warning("snapshot of %s/%s ended by timeout", self.name, keys)
        finally:
            await watcher.stop()
        return result

    async def watch(
        self, keys: str = ">", history: bool = False, caught_up: asyncio.Event | None = None
    ) -> AsyncIterator[Change[T]]:
        """Current values, then every change in order; a delete arrives with value None.
        `caught_up` is set once the current values have all been delivered."""
        expect_values = caught_up is not None and await self._matches_anything(keys)
        # Made again on each try: a watch is an ordered consumer, nothing to double.
        watcher = await retrying(
            lambda: self._kv.watch(keys, include_history=history), f"watch {self.name}", self._nc
        )
        try:
            async for entry in watcher:
                if entry is None:  # nats-py's marker: trusted only when nothing matched
                    if caught_up is not None and not expect_values:
                        caught_up.set()
                    continue
                if entry.operation in (KV_DEL, KV_PURGE) or not entry.value:
                    yield Change(entry.key, None, entry.revision or 0)
                else:
                    value = self._decode_or_skip(entry.key, entry.value)
                    if value is not None:
                        yield Change(entry.key, value, entry.revision or 0)
                if caught_up is not None and not caught_up.is_set() and entry.delta == 0:
                    caught_up.set()
        finally:
            try:
                await asyncio.shield(watcher.stop())
            except nats.errors.ConnectionClosedError:
                pass  # closing down: the server forgets the watch with the connection

    def _decode(self, key: str, data: bytes) -> T:
        try:
            return decode(data, self.kind)
        except msgspec.ValidationError as error:
            raise NodusError(
                ErrorCode.INTERNAL, f"{self.name}/{key} holds a malformed record: {error}"
            ) from error

    def _decode_or_skip(self, key: str, data: bytes) -> T | None:
        try:
            return decode(data, self.kind)
        except msgspec.DecodeError as error:  # not JSON at all, or not the record (S3)
            MALFORMED_RECORDS.labels(self.name).inc()
            log.warning("skipping malformed record %s/%s: %s", self.name, key, error)
            return None

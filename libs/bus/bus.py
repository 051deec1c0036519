"""The bus: one NATS connection, the journal (streams and KV) checked at start, requests and
services whose failures are readable errors with stable codes (C1, C7)."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType, StreamConfig
from nats.js.kv import KeyValue
from nats.micro.request import Request
from nats.micro.service import Service, ServiceConfig
from nats.nuid import NUID

from libs.bus.acks import Acks
from libs.bus.connection import DRAIN_SECONDS, connect, jetstream, refusal_of
from libs.bus.kv import Bucket, named_watches
from libs.bus.retry import retrying
from libs.contracts import names
from libs.contracts.base import decode, encode
from libs.contracts.errors import ErrorCode, ErrorReply, NodusError
from libs.contracts.names import EVENTS_STREAM, EVENTS_SUBJECTS, USAGE_STREAM, USAGE_SUBJECTS

log = logging.getLogger("nodus.bus")

S = TypeVar("S", bound=msgspec.Struct)
R = TypeVar("R", bound=msgspec.Struct)
Req = TypeVar("Req", bound=msgspec.Struct)
Rep = TypeVar("Rep", bound=msgspec.Struct)

_MESSAGE_IDS = NUID()  # one generator: making a NUID draws a random prefix each time
# A request nobody answers is asked again after these pauses (then the last, until the
# caller's patience ends): a subscription made an instant ago on another connection can be
# missed by the server for a moment, and a service restarting answers again in seconds.
NO_RESPONDER_PAUSES = (0.02, 0.05, 0.1, 0.25)
NO_RESPONDER_PATIENCE_SECONDS = 0.17  # by default, the moment only: a real absence outlasts it
# A JetStream API request nobody answers this long reached a server without JetStream: the
# daemon says so then, instead of after the whole failover allowance (RETRY_SECONDS). Long
# enough for a server that was just restarted to start its JetStream.
NO_JETSTREAM_SECONDS = 10.0
ERROR_HEADER = "Nats-Service-Error"

# History kept per key: enough for `describe` to show recent transitions.
BUCKET_HISTORY = {names.BUCKET_JOBS: 10, names.BUCKET_RANKTABLES: 10, names.BUCKET_EPOCHS: 5}


def replicas() -> int:
    """Copies of each stream and bucket: 3 on a clustered bus (`nodus bus init`), set by
    NODUS_BUS_REPLICAS for the processes that create them; 1 on a single server."""
    value = os.environ.get("NODUS_BUS_REPLICAS", "1")
    if not value.isdigit() or not 1 <= int(value) <= 5:
        raise NodusError(ErrorCode.INVALID, f"NODUS_BUS_REPLICAS={value!r}: a number, 1 to 5")
    return int(value)


class Bus:
    """What a service holds: the connection, JetStream, typed buckets."""

    def __init__(self, nc: Client, js: JetStreamContext) -> None:
        self.nc = nc
        self.js = js
        self._buckets: dict[str, Any] = {}
        self.acks = Acks(nc)  # every JetStream write of this connection
        self._services: list[Service] = []
        self.replicas = replicas()  # copies of what it creates
        # A user confined to its own keys (an agent, a machine's monitor): it may not ask a
        # bucket's stream about itself, whose answer lists every key's name (S1).
        self.confined = False

    @classmethod
    async def open(
        cls,
        url: str | None = None,
        name: str = "nodus",
        credentials: str | None = None,
        buckets: list[str] | None = None,
        streams: bool = False,
        inbox_prefix: str | None = None,
        replicas: int | None = None,
        confined: bool = False,
    ) -> Bus:
        """Connect and make sure the journal is there (C7): refuse to start without it.
        Streams and buckets it creates keep `replicas` copies (default NODUS_BUS_REPLICAS).
        `confined`: a user that may use only its own keys (see `Bus.confined`)."""
        nc = await connect(url, name=name, credentials=credentials, inbox_prefix=inbox_prefix)
        bus = cls(nc, jetstream(nc))
        bus.confined = confined
        if replicas is not None:
            bus.replicas = replicas
        try:
            if streams:
                await bus.ensure_stream(EVENTS_STREAM, EVENTS_SUBJECTS)
                await bus.ensure_stream(USAGE_STREAM, USAGE_SUBJECTS)
            for bucket in buckets or []:
                await bus.ensure_bucket(bucket)
        except BaseException:
            await nc.close()
            raise
        return bus

    async def ensure_stream(self, name: str, subjects: list[str]) -> None:
        try:
            try:
                await retrying(
                    lambda: self.js.stream_info(name),
                    f"open {name}",
                    self.nc,
                    no_responders_seconds=NO_JETSTREAM_SECONDS,
                )
            except nats.js.errors.NotFoundError:
                config = StreamConfig(
                    name=name,
                    subjects=subjects,
                    storage=StorageType.FILE,
                    duplicate_window=120.0,
                    num_replicas=self.replicas,
                )
                try:
                    await retrying(lambda: self.js.add_stream(config), f"create {name}", self.nc)
                except nats.js.errors.BadRequestError:
                    await self.js.stream_info(name)  # made by another process, or a lost answer
        except NodusError:
            raise
        except Exception as error:
            raise _journal_error(f"stream {name}", error) from error

    async def ensure_bucket(self, name: str) -> None:
        if self.confined:
            # Bound as it is, asking nothing: a confined user's first read or watch of its
            # own keys is where a missing bucket shows. The control plane makes the buckets
            # and turns on direct reads, which a confined user's permissions require.
            kv = KeyValue(
                name=name, stream=f"KV_{name}", pre=f"$KV.{name}.", js=self.js, direct=True
            )
            self._buckets[name] = named_watches(kv)
            return
        try:
            # A daemon that starts while a server fails over waits for the bus (S4), as
            # every later call does; a refusal (S1) is not retried.
            try:
                kv = await retrying(
                    lambda: self.js.key_value(name),
                    f"open {name}",
                    self.nc,
                    no_responders_seconds=NO_JETSTREAM_SECONDS,
                )
            except nats.js.errors.BucketNotFoundError:
                config = KeyValueConfig(
                    bucket=name,
                    history=BUCKET_HISTORY.get(name, 1),
                    storage=StorageType.FILE,
                    # Reads by key name the key in the API subject: NATS
                    # permissions can then confine a reader to its keys (S1).
                    direct=True,
                    replicas=self.replicas,
                )
                try:
                    kv = await retrying(
                        lambda: self.js.create_key_value(config), f"create {name}", self.nc
                    )
                except nats.js.errors.BadRequestError:
                    kv = await self.js.key_value(name)  # another process created it first
                except nats.errors.TimeoutError:
                    raise NodusError(
                        ErrorCode.JOURNAL_UNAVAILABLE,
                        f"KV bucket {name} does not exist, and this process's bus user may "
                        "not create it: start the control plane (the placer) first",
                    ) from None
            if not kv._direct:
                kv = await self._allow_direct(name, kv)
        except NodusError:
            raise
        except Exception as error:
            if isinstance(error, nats.errors.TimeoutError):
                error = TimeoutError(
                    "no answer: does this process's bus user have permission to use it?"
                )
            raise _journal_error(f"KV bucket {name}", error) from error
        self._buckets[name] = named_watches(kv)

    async def _allow_direct(self, name: str, kv: KeyValue) -> KeyValue:
        """A bucket made before S1 reads keys through an API that names no key; turn on
        direct reads once, so confined readers can read theirs."""
        try:
            info = await self.js.stream_info(f"KV_{name}")
            info.config.allow_direct = True
            await self.js.update_stream(info.config)
            return await self.js.key_value(name)
        except Exception as error:  # a confined process may not; the control plane will
            log.warning("bucket %s: cannot turn on direct reads: %r", name, error)
            return kv

    def bucket(self, name: str, kind: type[S]) -> Bucket[S]:
        if name not in self._buckets:
            raise NodusError(ErrorCode.INTERNAL, f"bucket {name} was not opened at start")
        return Bucket(self._buckets[name], kind, name, self.acks, self.confined)

    async def replay(self, stream: str, subject: str, timeout: float = 30.0) -> list[Msg]:
        """Every message `stream` holds on `subject`, oldest first, each once. The stream says
        how many match, and each is read, however long a bus failing over takes to deliver
        them: a read that stops at the first pause would miss some (bytes unbilled, events
        unseen). An ordered consumer that resets while a server fails over can hand a message
        twice or pass one by (chaos seed 276742: an event in every replica, missing from the
        read), so messages are kept by their stream sequence and a read that falls short is
        made again from the start until every message is in."""
        info = await retrying(
            lambda: self.js.stream_info(stream, subjects_filter=subject),
            f"count {subject}",
            self.nc,
        )
        expected = sum((info.state.subjects or {}).values())
        if not expected:
            return []
        by_sequence: dict[int, Msg] = {}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            # The consumer's creation is a JetStream request too: a server failing over may
            # let it time out, and an ordered consumer is made afresh each try.
            sub = await retrying(
                lambda: self.js.subscribe(subject, stream=stream, ordered_consumer=True),
                f"read {subject}",
                self.nc,
            )
            try:
                while len(by_sequence) < expected:
                    try:
                        msg = await sub.next_msg(timeout=1.0)
                    except nats.errors.TimeoutError:
                        break  # a pause: read again from the start, or give up at the deadline
                    by_sequence.setdefault(msg.metadata.sequence.stream, msg)
            finally:
                await sub.unsubscribe()
            if len(by_sequence) >= expected:
                return [by_sequence[seq] for seq in sorted(by_sequence)]
            if loop.time() > deadline:
                raise NodusError(
                    ErrorCode.TIMEOUT,
                    f"{stream}: read {len(by_sequence)} of the {expected} messages on "
                    f"{subject} within {timeout:g} s",
                )
            log.info(
                "%s: read %d of the %d messages on %s; reading again",
                stream,
                len(by_sequence),
                expected,
                subject,
            )

    async def user_info(self, timeout: float = 5.0) -> dict[str, Any]:
        """Who the server says this connection is: its user (public key) and, for a confined
        user, its permissions (`$SYS.REQ.USER.INFO`)."""
        try:
            msg = await self.nc.request("$SYS.REQ.USER.INFO", b"", timeout=timeout)
            answer = msgspec.json.decode(msg.data)
        except (nats.errors.Error, msgspec.DecodeError) as error:
            raise NodusError(
                ErrorCode.TIMEOUT, f"the bus did not say who this user is: {error!r}"
            ) from None
        data = answer.get("data") if isinstance(answer, dict) else None
        if not isinstance(data, dict):
            raise NodusError(ErrorCode.TIMEOUT, f"the bus did not say who this user is: {answer}")
        return data

    async def request(
        self,
        subject: str,
        body: msgspec.Struct,
        reply: type[R],
        timeout: float = 5.0,
        unanswered_seconds: float = NO_RESPONDER_PATIENCE_SECONDS,
    ) -> R:
        """A request whose every failure is a NodusError with a stable code (C1). While nobody
        answers it is asked again, for up to `unanswered_seconds`: only a request that is safe
        to repeat should be given more than the default moment."""
        data = encode(body)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + unanswered_seconds
        try:
            for attempt in itertools.count():
                try:
                    msg = await self.nc.request(subject, data, timeout=timeout)
                    break
                except nats.errors.NoRespondersError:
                    if loop.time() >= deadline:
                        raise
                    pause = NO_RESPONDER_PAUSES[min(attempt, len(NO_RESPONDER_PAUSES) - 1)]
                    await asyncio.sleep(min(pause, max(deadline - loop.time(), 0.0)))
        except nats.errors.NoRespondersError:
            raise NodusError(
                ErrorCode.NO_RESPONDERS,
                f"nobody answers {subject}: the service or agent it names is not running",
            ) from None
        except nats.errors.TimeoutError:
            refusal = refusal_of(self.nc, subject)
            if refusal is not None:
                raise NodusError(
                    ErrorCode.UNAUTHORIZED,
                    f"the bus does not let this user send {subject} ({refusal}): "
                    "its credentials are another's (S1)",
                ) from None
            raise NodusError(
                ErrorCode.TIMEOUT, f"no answer on {subject} within {timeout:g}s"
            ) from None
        headers = msg.headers or {}
        if ERROR_HEADER in headers:
            try:
                error = decode(msg.data, ErrorReply)
            except msgspec.DecodeError:
                error = ErrorReply(code=ErrorCode.INTERNAL, message=headers[ERROR_HEADER])
            raise NodusError.from_reply(error)
        try:
            return decode(msg.data, reply)
        except msgspec.DecodeError as bad:
            raise NodusError(ErrorCode.INTERNAL, f"malformed reply on {subject}: {bad}") from bad

    async def publish(
        self, subject: str, body: msgspec.Struct, dedup_id: str | None = None
    ) -> None:
        """Publish into a stream, once: a retry after a lost answer carries the same
        `Nats-Msg-Id` (`dedup_id`, or one made here), which the stream deduplicates."""
        headers = {"Nats-Msg-Id": dedup_id or _MESSAGE_IDS.next().decode()}
        data = encode(body)
        await retrying(
            lambda: self.acks.publish(subject, data, headers), f"publish {subject}", self.nc
        )

    async def serve(
        self,
        name: str,
        version: str,
        description: str,
        endpoints: list[Endpoint[Any, Any]],
        queue_group: str | None = None,
    ) -> Service:
        """A nats micro service: answers `$SRV.PING/INFO/STATS` like any NATS service."""
        config = ServiceConfig(
            name=name, version=version, description=description, queue_group=queue_group
        )
        service = Service(self.nc, config)
        try:
            await service.start()  # its subscriptions, then a flush
        except nats.errors.FlushTimeoutError:
            # The subscriptions are made; the server failing over answers the flush late (an
            # agent restarted in chaos exited so, seed 1). The flush below is retried.
            pass
        for endpoint in endpoints:
            await service.add_endpoint(
                name=endpoint.name, subject=endpoint.subject, handler=endpoint.handle
            )
        # The server must know the subscriptions before anyone is told this service is up;
        # a server failing over answers the flush late (an agent started then exited on a
        # flush timeout in chaos), and the subscriptions are sent again on the reconnect.
        await retrying(self.nc.flush, f"serve {name}", self.nc)
        self._services.append(service)
        return service

    async def close(self) -> None:
        for service in self._services:
            try:
                # nats-py's drain of a micro service can wait forever on its queue; bound it.
                await asyncio.wait_for(service.stop(), timeout=2.0)
            except (Exception, TimeoutError) as error:  # best effort on the way out
                log.debug("service stop: %s", error)
        self._services.clear()
        if not self.nc.is_closed:
            try:
                # Bounded by nats-py itself (DRAIN_SECONDS, set at connect): a handler still
                # running is given that long, then the connection closes. The wait_for is
                # only a backstop for a drain that hangs past its own bound.
                await asyncio.wait_for(self.nc.drain(), timeout=DRAIN_SECONDS + 3.0)
            except Exception:
                await self.nc.close()


class Endpoint(Generic[Req, Rep]):
    """One request/reply endpoint: decodes the body, maps every failure to a readable error."""

    def __init__(
        self,
        name: str,
        subject: str,
        request: type[Req],
        handler: Callable[[Req], Awaitable[Rep]],
        concurrency: int = 1,
    ) -> None:
        self._setup(name, subject, request, concurrency)
        self.handler = handler

    @classmethod
    def of_agent(
        cls,
        node: str,
        verb: names.AgentVerb,
        request: type[Req],
        handler: Callable[[Req], Awaitable[Rep]],
        concurrency: int = 1,
    ) -> Endpoint[Req, Rep]:
        """The endpoint of one node's agent that answers `verb`."""
        return cls(verb.value, names.node_request(node, verb), request, handler, concurrency)

    def _setup(self, name: str, subject: str, request: type[Req], concurrency: int) -> None:
        self.name = name
        self.subject = subject
        self.request = request
        # nats-py delivers one message at a time per subscription; handlers that wait on I/O
        # run as tasks, at most `concurrency` at once (a full set holds the subscription back).
        self._slots = asyncio.Semaphore(concurrency) if concurrency > 1 else None
        self._running: set[asyncio.Task[None]] = set()

    async def handle(self, request: Request) -> None:
        if self._slots is None:
            await self._handle(request)
            return
        await self._slots.acquire()
        task = asyncio.create_task(self._handle(request))
        self._running.add(task)
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task[None]) -> None:
        self._running.discard(task)
        if self._slots is not None:
            self._slots.release()

    async def _handle(self, request: Request) -> None:
        try:
            body = decode(request.data, self.request)
        except (msgspec.ValidationError, msgspec.DecodeError) as error:
            await _respond_error(
                request, NodusError(ErrorCode.INVALID, f"malformed request: {error}")
            )
            return
        try:
            reply = await self._call(body, request.subject)
        except NodusError as error:
            await _respond_error(request, error)
            return
        except Exception as error:
            log.exception("handler %s failed", self.name)
            await _respond_error(request, NodusError(ErrorCode.INTERNAL, f"{self.name}: {error!r}"))
            return
        await request.respond(encode(reply))

    async def _call(self, body: Req, subject: str) -> Rep:
        return await self.handler(body)


class CallerEndpoint(Endpoint[Req, Rep]):
    """An endpoint on `prefix.*` whose handler is told the caller: the subject's last token,
    which the bus's permissions fix to the sender's own name (S1, R8)."""

    def __init__(
        self,
        name: str,
        prefix: str,
        request: type[Req],
        handler: Callable[[Req, str], Awaitable[Rep]],
        concurrency: int = 1,
    ) -> None:
        self._setup(name, f"{prefix}.*", request, concurrency)
        self.prefix = prefix
        self.caller_handler = handler

    async def _call(self, body: Req, subject: str) -> Rep:
        return await self.caller_handler(body, subject[len(self.prefix) + 1 :])


async def _respond_error(request: Request, error: NodusError) -> None:
    await request.respond_error(error.code.value, error.message, data=encode(error.to_reply()))


def _journal_error(what: str, error: Exception) -> NodusError:
    return NodusError(
        ErrorCode.JOURNAL_UNAVAILABLE,
        f"the journal is mandatory and {what} is unavailable: {error!r} "
        "(is JetStream enabled on the NATS server? `nodus up` starts it with -js)",
    )

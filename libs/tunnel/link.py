"""One link per pair of members: many TCP streams, each with credit-based flow control, over
an ordered transport that may lose a tail of messages when a relay dies.

Every message but ACK carries a link sequence number. The receiver takes only the next number
and acknowledges cumulatively; the sender keeps what is unacknowledged and sends it all again
when told the path changed (`retransmit`) or when acknowledgements stall (go-back-N). So data
in flight on a relay that dies arrives through the other one: nothing lost, duplicated or
reordered, and no inner connection breaks. There is no congestion control here: the relays'
TCP connections already provide it.

Wire format, inside WireGuard transport payloads (several messages per payload):
    u8 kind | u32 seq | u32 stream | u32 length | body[length]
"""

from __future__ import annotations

import struct
from collections import deque
from dataclasses import dataclass

from libs.contracts.bounds import LINK_MAX_INFLIGHT_BYTES, STREAM_WINDOW_BYTES
from libs.socks5.codec import ReplyCode

HEADER = struct.Struct(">BIII")
U32 = struct.Struct(">I")
OPEN_BODY = struct.Struct(">HI")

OPEN, OPEN_OK, OPEN_FAIL, DATA, CREDIT, FIN, RST, ACK = range(1, 9)
SEQ_MOD = 1 << 32

# SOCKS5 reply codes travel as the reason of a failed open or a reset (the shim maps them to
# the errno a direct connect would give).
GENERAL_FAILURE = int(ReplyCode.GENERAL_FAILURE)


Piece = bytes | memoryview
# A message as kept until acknowledged: its header and body, not joined (a DATA body is a view
# of what the program's socket read). A payload is the pieces of the messages it packs, written
# one after the other: WireGuard's framing copies them into its plaintext, the only copy.
Message = tuple[bytes, Piece]
Payload = list[Piece]


class LinkError(ValueError):
    """Malformed link input from an authenticated peer: the caller counts it and resets."""


@dataclass(frozen=True, slots=True)
class StreamOpened:
    stream: int
    port: int


@dataclass(frozen=True, slots=True)
class OpenResult:
    stream: int
    ok: bool
    code: int


@dataclass(frozen=True, slots=True)
class Data:
    """Bytes the peer sent on the stream: a view of the payload they came in (not a copy)."""

    stream: int
    data: memoryview


@dataclass(frozen=True, slots=True)
class CreditAvailable:
    stream: int


@dataclass(frozen=True, slots=True)
class Closed:
    """The peer will send no more on this stream (half close)."""

    stream: int


@dataclass(frozen=True, slots=True)
class Reset:
    stream: int
    code: int


Event = StreamOpened | OpenResult | Data | CreditAvailable | Closed | Reset


@dataclass(slots=True)
class _Stream:
    credit: int = 0  # bytes we may still send
    consumed: int = 0  # bytes delivered and written out since we last granted credit
    sent_fin: bool = False
    got_fin: bool = False
    open: bool = False


class Link:
    def __init__(
        self,
        side: int,
        window: int = STREAM_WINDOW_BYTES,
        max_payload: int = 60 * 1024,
        chunk: int = 60 * 1024 - HEADER.size,  # one DATA message fills a WireGuard payload
        rto: float = 2.0,
        max_inflight: int = LINK_MAX_INFLIGHT_BYTES,
    ) -> None:
        if side not in (0, 1):
            raise ValueError("side is 0 or 1")
        self.side = side
        self.window = window
        self.max_payload = max_payload
        self.chunk = chunk
        self.rto = rto
        # Bytes sent and not yet acknowledged, across every stream: what relays may hold for
        # this pair at once, however many streams are open (they size their queues by it).
        self.max_inflight = max_inflight
        self._inflight = 0
        self._blocked: set[int] = set()  # streams that had credit but no room on the link
        self.streams: dict[int, _Stream] = {}
        self._next_stream = 2 + side
        # sender
        self._next_seq = 0
        self._unacked: deque[tuple[int, Message]] = deque()
        self._unsent = 0  # how many of the newest unacked messages are to be transmitted
        self._fresh = 0  # how many of those were never transmitted (the newest ones)
        self._last_progress: float | None = None  # when acknowledgements last moved
        self._backoff = 1  # doubles with each resend that brought no progress
        # receiver
        self._expected = 0
        self._since_ack = 0
        self._ack_due = False
        self.stats = {"retransmits": 0, "duplicates": 0, "gaps": 0}

    # -- what the application does ------------------------------------------------------------

    def open_stream(self, port: int) -> int:
        stream = self._next_stream
        self._next_stream += 2
        self.streams[stream] = _Stream()
        self._queue(OPEN, stream, OPEN_BODY.pack(port, self.window))
        return stream

    def accept(self, stream: int) -> None:
        state = self.streams[stream]
        state.open = True
        self._queue(OPEN_OK, stream, U32.pack(self.window))

    def refuse(self, stream: int, code: int) -> None:
        self.streams.pop(stream, None)
        self._queue(OPEN_FAIL, stream, bytes((code,)))

    def credit(self, stream: int) -> int:
        """How many bytes `stream` may send now: its credit, while the link has room. The
        room is a soft cap (one send may overshoot it; it never splits a send), and a stream
        held back by it alone gets CreditAvailable when acknowledgements free room."""
        state = self.streams.get(stream)
        if state is None or not state.open or state.sent_fin:
            return 0
        if self._inflight >= self.max_inflight and state.credit > 0:
            self._blocked.add(stream)
            return 0
        return state.credit

    def send(self, stream: int, data: bytes | bytearray | memoryview) -> int:
        """Queue up to the stream's credit; returns how many bytes were taken (all of them,
        when `data` is no longer than `credit(stream)` said). The link keeps views of `data`
        until the peer acknowledges them: a buffer the caller may change is copied first."""
        state = self.streams.get(stream)
        if state is None or not state.open or state.sent_fin:
            return 0
        taken = min(len(data), state.credit)
        if taken <= 0:
            return 0
        view = memoryview(data)
        if not view.readonly:
            view = memoryview(bytes(view[:taken]))
        for at in range(0, taken, self.chunk):
            self._queue(DATA, stream, view[at : min(taken, at + self.chunk)])
        state.credit -= taken
        return taken

    def peer_finished(self, stream: int) -> bool:
        """The peer sent FIN on `stream` (it will send no more)."""
        state = self.streams.get(stream)
        return state is not None and state.got_fin

    def consumed(self, stream: int, size: int) -> None:
        """The application wrote `size` delivered bytes out: grant them back in batches."""
        state = self.streams.get(stream)
        if state is None:
            return
        state.consumed += size
        if state.consumed >= self.window // 4:
            self._queue(CREDIT, stream, U32.pack(state.consumed))
            state.consumed = 0

    def finish(self, stream: int) -> None:
        state = self.streams.get(stream)
        if state is None or state.sent_fin:
            return
        state.sent_fin = True
        self._queue(FIN, stream, b"")
        self._maybe_forget(stream, state)

    def reset(self, stream: int, code: int = GENERAL_FAILURE) -> None:
        if self.streams.pop(stream, None) is not None:
            self._queue(RST, stream, bytes((code,)))

    # -- the transport -------------------------------------------------------------------------

    def outgoing(self) -> list[bytes]:
        """Payloads to send now, resent ones first, each joined (see `outgoing_parts`)."""
        resent, fresh = self.outgoing_parts()
        return [b"".join(payload) for payload in resent + fresh]

    def outgoing_parts(self) -> tuple[list[Payload], list[Payload]]:
        """Payloads to send now, in the order they go: every unacknowledged message sent again
        after `retransmit`, then the fresh ones (an acknowledgement if one is due, and every
        message never transmitted), each group packed up to max_payload. Kept apart so the
        sender can count what its programs sent once (the relays bill that, G17)."""
        fresh_from = len(self._unacked) - self._fresh
        resent = [self._unacked[i][1] for i in range(len(self._unacked) - self._unsent, fresh_from)]
        fresh: list[Message] = []
        if self._ack_due:
            fresh.append((HEADER.pack(ACK, self._expected, 0, 0), b""))
            self._ack_due = False
            self._since_ack = 0
        fresh += [self._unacked[i][1] for i in range(fresh_from, len(self._unacked))]
        self._unsent = self._fresh = 0
        return self._packed(resent), self._packed(fresh)

    def acknowledgement_parts(self) -> list[Payload]:
        """The acknowledgement alone, if one is due: what a sender whose numbered messages
        wait (a move to another relay, once what is in flight is acknowledged) still sends,
        so the peer's own messages keep flowing meanwhile."""
        if not self._ack_due:
            return []
        self._ack_due = False
        self._since_ack = 0
        return [[HEADER.pack(ACK, self._expected, 0, 0)]]

    @property
    def awaiting_acknowledgement(self) -> int:
        """Messages transmitted and not yet acknowledged (those never transmitted left out)."""
        return len(self._unacked) - self._fresh

    def _packed(self, messages: list[Message]) -> list[Payload]:
        payloads: list[Payload] = []
        batch: Payload = []
        size = 0
        for header, body in messages:
            length = len(header) + len(body)
            if batch and size + length > self.max_payload:
                payloads.append(batch)
                batch, size = [], 0
            batch.append(header)
            if body:
                batch.append(body)
            size += length
        if batch:
            payloads.append(batch)
        return payloads

    def retransmit(self) -> None:
        """The path changed (or acknowledgements stalled): send everything unacknowledged again."""
        if self._unacked:
            self.stats["retransmits"] += 1
        self._unsent = len(self._unacked)

    def tick(self, now: float) -> bool:
        """Timers: True when `outgoing()` has something (an acknowledgement or a resend)."""
        if self._unacked and self._unsent == 0:
            if self._last_progress is None:
                self._last_progress = now
            elif now - self._last_progress > self.rto * self._backoff:
                # A fallback for silent loss (a dead relay is noticed and resent on at once):
                # back off, so a receiver that is only slow is not flooded with duplicates.
                self.retransmit()
                self._last_progress = now
                self._backoff = min(self._backoff * 2, 8)
        elif not self._unacked:
            self._last_progress = None
        if self._since_ack:
            self._ack_due = True
        return self._ack_due or self._unsent > 0

    def next_deadline(self, now: float) -> float | None:
        """When `tick` next has work: `now` while an acknowledgement is owed or the resend
        clock has to start, the resend fallback's time while messages wait unacknowledged,
        None while there is nothing to time."""
        if self._since_ack:
            return now
        if self._unacked and self._unsent == 0:
            if self._last_progress is None:
                return now
            return self._last_progress + self.rto * self._backoff
        return None

    def keepalive(self) -> None:
        """Send an acknowledgement even if nothing arrived: the peer hears from us, so it can
        tell a live link from a silent one without waiting on a request."""
        self._ack_due = True

    @property
    def unacked(self) -> int:
        return len(self._unacked)

    def receive(self, payload: bytes | bytearray, now: float = 0.0) -> list[Event]:
        """The events of one payload. `Data` events are views of `payload`: the caller leaves
        it unchanged from then on."""
        events: list[Event] = []
        view = memoryview(payload)
        at = 0
        while at < len(view):
            if len(view) - at < HEADER.size:
                raise LinkError("truncated link header")
            kind, seq, stream, length = HEADER.unpack_from(view, at)
            at += HEADER.size
            if length > len(view) - at:
                raise LinkError("truncated link message")
            body = view[at : at + length]
            at += length
            if kind == ACK:
                self._acked(seq, now, events)
                continue
            if seq != self._expected:
                if (self._expected - seq) % SEQ_MOD < SEQ_MOD // 2:
                    self.stats["duplicates"] += 1
                else:
                    self.stats["gaps"] += 1  # a lost tail: the sender goes back and resends
                self._ack_due = True
                continue
            self._expected = (self._expected + 1) % SEQ_MOD
            self._since_ack += 1
            if self._since_ack >= 8:
                self._ack_due = True
            self._handle(kind, stream, body, events)
        return events

    # -- internals -----------------------------------------------------------------------------

    def _queue(self, kind: int, stream: int, body: bytes | memoryview) -> None:
        header = HEADER.pack(kind, self._next_seq, stream, len(body))
        self._unacked.append((self._next_seq, (header, body)))
        self._inflight += len(header) + len(body)
        self._next_seq = (self._next_seq + 1) % SEQ_MOD
        self._unsent += 1
        self._fresh += 1

    def _acked(self, next_expected: int, now: float, events: list[Event]) -> None:
        progressed = False
        while self._unacked and 0 < (next_expected - self._unacked[0][0]) % SEQ_MOD <= SEQ_MOD // 2:
            header, body = self._unacked.popleft()[1]
            self._inflight -= len(header) + len(body)
            progressed = True
        if self._blocked and self._inflight < self.max_inflight:
            for stream in sorted(self._blocked):
                if stream in self.streams:
                    events.append(CreditAvailable(stream))
            self._blocked.clear()
        self._unsent = min(self._unsent, len(self._unacked))
        self._fresh = min(self._fresh, self._unsent)
        if progressed:
            self._last_progress = now if self._unacked else None
            self._backoff = 1

    def _handle(self, kind: int, stream: int, body: memoryview, events: list[Event]) -> None:
        state = self.streams.get(stream)
        if kind == OPEN:
            if len(body) != OPEN_BODY.size or stream % 2 == self.side or state is not None:
                raise LinkError(f"bad open of stream {stream}")
            port, credit = OPEN_BODY.unpack(body)
            self.streams[stream] = _Stream(credit=credit)
            events.append(StreamOpened(stream, port))
        elif kind == OPEN_OK:
            if state is None or len(body) != 4:
                return  # reset meanwhile
            state.open = True
            state.credit = U32.unpack(body)[0]
            events.append(OpenResult(stream, True, 0))
        elif kind == OPEN_FAIL:
            if self.streams.pop(stream, None) is not None:
                events.append(
                    OpenResult(stream, False, body[0] if len(body) == 1 else GENERAL_FAILURE)
                )
        elif kind == DATA:
            if state is not None:
                events.append(Data(stream, body))
        elif kind == CREDIT:
            if state is not None and len(body) == 4:
                had = state.credit
                state.credit += U32.unpack(body)[0]
                if had == 0 and state.credit > 0:
                    events.append(CreditAvailable(stream))
        elif kind == FIN:
            if state is not None and not state.got_fin:
                state.got_fin = True
                events.append(Closed(stream))
                self._maybe_forget(stream, state)
        elif kind == RST:
            if self.streams.pop(stream, None) is not None:
                events.append(Reset(stream, body[0] if len(body) == 1 else GENERAL_FAILURE))
        else:
            raise LinkError(f"unknown link message kind {kind}")

    def _maybe_forget(self, stream: int, state: _Stream) -> None:
        if state.sent_fin and state.got_fin:
            self.streams.pop(stream, None)

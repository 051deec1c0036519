"""Frames: `u32 length | u8 type | body`, length counting type and body, big-endian.

Member <-> relay:  Challenge (relay first), Hello, Welcome, Send, Recv, Ping, Pong, ErrorFrame,
                   Home, Sent; Route in place of Hello when the challenge came from another relay
                   of a host whose relays share one port (the member's relay is handed it).
Relay <-> relay:   Challenge, MeshHello, PresenceDump, Present, Absent, Forward, Ping, Pong.
The only payload a relay carries between members is a WireGuard message (types 1-4, G16).

Bulk bytes are not copied here (the relayed path's hot path): a decoded message is a read-only
view of the bytes the connection read, and a message frame is written as its header and that
view (`parts`), so a relay hands a member's message on without copying it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from libs.wg import message_type

MAX_FRAME = 1 << 17  # 128 KiB: a WireGuard message of up to 64 KiB plus headers
KEY = 32

_LEN = struct.Struct(">I")
_U16 = struct.Struct(">H")
_U64 = struct.Struct(">Q")
_HEAD = struct.Struct(">IB")  # length, type

Message = bytes | bytearray | memoryview  # a WireGuard message: a view of what was read, or bytes


class FrameError(ValueError):
    """Malformed input: the connection that sent it is dropped and the drop counted (S3)."""


@dataclass(frozen=True, slots=True)
class Challenge:
    relay_key: bytes  # the relay's X25519 public key
    nonce: bytes


@dataclass(frozen=True, slots=True)
class Hello:
    gang: str
    epoch: int
    node: str
    wg_key: bytes
    proof: bytes


@dataclass(frozen=True, slots=True)
class Welcome:
    relay: str
    region: str
    member_rate_bps: int


@dataclass(frozen=True, slots=True)
class Send:
    dst: bytes
    message: Message


@dataclass(frozen=True, slots=True)
class Recv:
    src: bytes
    message: Message


@dataclass(frozen=True, slots=True)
class Ping:
    data: bytes


@dataclass(frozen=True, slots=True)
class Pong:
    data: bytes


@dataclass(frozen=True, slots=True)
class ErrorFrame:
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class Home:
    """Member -> relay: "I send through you now"; `failover` when its previous relay was lost."""

    failover: bool


@dataclass(frozen=True, slots=True)
class Sent:
    """Member -> relay: what the member's programs have sent so far in this epoch, counted as
    relays meter it (the plaintext of WireGuard transport messages) and counted once: what it
    sends again after losing a relay is not in it. Relays bill the highest total any of them
    heard, within a bound of what they carried (libs/contracts/relay.py: billed_bytes)."""

    total: int


@dataclass(frozen=True, slots=True)
class Route:
    """A member's answer to a challenge from the wrong relay of a shared port: "hand me to
    `relay`", sent at most once per connection."""

    relay: str


@dataclass(frozen=True, slots=True)
class MeshHello:
    name: str
    proof: bytes


@dataclass(frozen=True, slots=True)
class Present:
    key: bytes
    gang: str
    epoch: int


@dataclass(frozen=True, slots=True)
class PresenceDump:
    entries: tuple[Present, ...]


@dataclass(frozen=True, slots=True)
class Absent:
    key: bytes


@dataclass(frozen=True, slots=True)
class Forward:
    src: bytes
    dst: bytes
    message: Message


Frame = (
    Challenge
    | Hello
    | Welcome
    | Send
    | Recv
    | Ping
    | Pong
    | ErrorFrame
    | Home
    | Sent
    | Route
    | MeshHello
    | Present
    | PresenceDump
    | Absent
    | Forward
)

T_CHALLENGE, T_HELLO, T_WELCOME, T_SEND, T_RECV, T_PING, T_PONG, T_ERROR, T_HOME, T_SENT = range(
    1, 11
)
T_ROUTE = 11
T_MESH_HELLO, T_PRESENCE_DUMP, T_PRESENT, T_ABSENT, T_FORWARD = range(16, 21)


def wireguard_type(message: Message) -> int | None:
    """The WireGuard message type if `message` is shaped like one, else None (G16)."""
    return message_type(message)


def _str(text: str) -> bytes:
    raw = text.encode()
    if len(raw) > 0xFFFF:
        raise FrameError("string too long")
    return _U16.pack(len(raw)) + raw


def _frame(kind: int, *parts: Message) -> bytes:
    length = 1 + sum(len(p) for p in parts)
    if length > MAX_FRAME:
        raise FrameError(f"frame of {length} bytes exceeds {MAX_FRAME}")
    return b"".join((_LEN.pack(length), bytes((kind,)), *parts))


def _message_head(kind: int, keys: bytes, message: Message) -> bytes:
    length = 1 + len(keys) + len(message)
    if length > MAX_FRAME:
        raise FrameError(f"frame of {length} bytes exceeds {MAX_FRAME}")
    return _HEAD.pack(length, kind) + keys


def parts(frame: Frame) -> list[Message]:
    """The frame's encoding in pieces to write one after the other: a message frame is its
    header and the message itself, not a copy of it."""
    match frame:
        case Send(dst, message):
            return [_message_head(T_SEND, dst, message), message]
        case Recv(src, message):
            return [_message_head(T_RECV, src, message), message]
        case Forward(src, dst, message):
            return [_message_head(T_FORWARD, src + dst, message), message]
    return [encode(frame)]


def encode(frame: Frame) -> bytes:
    match frame:
        case Send() | Recv() | Forward():
            return b"".join(parts(frame))
        case Challenge(relay_key, nonce):
            return _frame(T_CHALLENGE, relay_key, nonce)
        case Hello(gang, epoch, node, wg_key, proof):
            return _frame(T_HELLO, _str(gang), _U64.pack(epoch), _str(node), wg_key, proof)
        case Welcome(relay, region, rate):
            return _frame(T_WELCOME, _str(relay), _str(region), _U64.pack(rate))
        case Ping(data):
            return _frame(T_PING, data)
        case Pong(data):
            return _frame(T_PONG, data)
        case ErrorFrame(code, message):
            return _frame(T_ERROR, _str(code), _str(message))
        case Home(failover):
            return _frame(T_HOME, b"\x01" if failover else b"\x00")
        case Sent(total):
            return _frame(T_SENT, _U64.pack(total))
        case Route(relay):
            return _frame(T_ROUTE, _str(relay))
        case MeshHello(name, proof):
            return _frame(T_MESH_HELLO, _str(name), proof)
        case Present(key, gang, epoch):
            return _frame(T_PRESENT, key, _str(gang), _U64.pack(epoch))
        case PresenceDump(entries):
            body = [_U16.pack(len(entries))]
            for entry in entries:
                body += [entry.key, _str(entry.gang), _U64.pack(entry.epoch)]
            return _frame(T_PRESENCE_DUMP, *body)
        case Absent(key):
            return _frame(T_ABSENT, key)
    raise FrameError(f"cannot encode {frame!r}")


class _Reader:
    def __init__(self, body: memoryview) -> None:
        self.body = body
        self.at = 0

    def take(self, n: int) -> bytes:
        if self.at + n > len(self.body):
            raise FrameError("frame body too short")
        out = bytes(self.body[self.at : self.at + n])
        self.at += n
        return out

    def string(self) -> str:
        (n,) = _U16.unpack(self.take(2))
        try:
            return self.take(n).decode()
        except UnicodeDecodeError:
            raise FrameError("string is not UTF-8") from None

    def u64(self) -> int:
        return int(_U64.unpack(self.take(8))[0])

    def rest(self) -> bytes:
        out = bytes(self.body[self.at :])
        self.at = len(self.body)
        return out

    def done(self) -> None:
        if self.at != len(self.body):
            raise FrameError("trailing bytes in frame")


def _decode(kind: int, body: memoryview) -> Frame:
    """One frame; a message frame's message is `body`'s own view (the caller's bytes must not
    change: they are immutable bytes)."""
    if kind == T_SEND or kind == T_RECV:
        if len(body) < KEY:
            raise FrameError("frame body too short")
        key = bytes(body[:KEY])
        return Send(key, body[KEY:]) if kind == T_SEND else Recv(key, body[KEY:])
    if kind == T_FORWARD:
        if len(body) < 2 * KEY:
            raise FrameError("frame body too short")
        return Forward(bytes(body[:KEY]), bytes(body[KEY : 2 * KEY]), body[2 * KEY :])
    r = _Reader(body)
    frame: Frame
    if kind == T_CHALLENGE:
        frame = Challenge(r.take(KEY), r.take(32))
    elif kind == T_HELLO:
        frame = Hello(r.string(), r.u64(), r.string(), r.take(KEY), r.take(32))
    elif kind == T_WELCOME:
        frame = Welcome(r.string(), r.string(), r.u64())
    elif kind == T_PING:
        frame = Ping(r.take(8))
    elif kind == T_PONG:
        frame = Pong(r.take(8))
    elif kind == T_ERROR:
        frame = ErrorFrame(r.string(), r.string())
    elif kind == T_HOME:
        flag = r.take(1)[0]
        if flag > 1:
            raise FrameError("home flag must be 0 or 1")
        frame = Home(bool(flag))
    elif kind == T_SENT:
        frame = Sent(r.u64())
    elif kind == T_ROUTE:
        frame = Route(r.string())
    elif kind == T_MESH_HELLO:
        frame = MeshHello(r.string(), r.take(32))
    elif kind == T_PRESENT:
        frame = Present(r.take(KEY), r.string(), r.u64())
    elif kind == T_PRESENCE_DUMP:
        (count,) = _U16.unpack(r.take(2))
        frame = PresenceDump(tuple(Present(r.take(KEY), r.string(), r.u64()) for _ in range(count)))
    elif kind == T_ABSENT:
        frame = Absent(r.take(KEY))
    else:
        raise FrameError(f"unknown frame type {kind}")
    r.done()
    return frame


class FrameDecoder:
    """Feed bytes as they arrive; get whole frames. Raises FrameError on malformed input.

    Frames that arrive whole in one read are decoded in place (their messages are views of
    that read); only a frame split between reads is copied, once, to join its halves."""

    def __init__(self, max_frame: int = MAX_FRAME) -> None:
        self._buffer = bytearray()  # the start of a frame the last read did not complete
        self._max = max_frame

    def feed(self, data: bytes | bytearray | memoryview) -> list[Frame]:
        if type(data) is not bytes:
            data = bytes(data)  # views must not see a caller's buffer change under them
        frames: list[Frame] = []
        at = 0
        if self._buffer:
            at = self._complete(data, frames)
            if self._buffer:
                return frames
        view = memoryview(data)
        end = len(data)
        limit = self._max
        while end - at >= 5:
            length, kind = _HEAD.unpack_from(data, at)
            if length < 1 or length > limit:
                raise FrameError(f"frame length {length} out of range")
            if end - at - 4 < length:
                break
            frames.append(_decode(kind, view[at + 5 : at + 4 + length]))
            at += 4 + length
        if at < end:
            self._buffer += view[at:]
        return frames

    def _complete(self, data: bytes, frames: list[Frame]) -> int:
        """Finish the split frame from the head of `data`: how many bytes of it were used."""
        buffer = self._buffer
        at = 0
        if len(buffer) < 4:
            at = min(4 - len(buffer), len(data))
            buffer += data[:at]
            if len(buffer) < 4:
                return at
        length: int = _LEN.unpack_from(buffer)[0]
        if length < 1 or length > self._max:
            raise FrameError(f"frame length {length} out of range")
        take = min(4 + length - len(buffer), len(data) - at)
        buffer += memoryview(data)[at : at + take]
        at += take
        if len(buffer) == 4 + length:
            whole = bytes(buffer)
            buffer.clear()
            frames.append(_decode(whole[4], memoryview(whole)[5:]))
        return at

    @property
    def buffered(self) -> int:
        return len(self._buffer)

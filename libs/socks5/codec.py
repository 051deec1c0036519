"""SOCKS5 (RFC 1928) without I/O: bytes in, events and bytes out, as in h11.

The server side is `ServerCodec`: feed it what the client sent with `receive_data`; it
answers the greeting by itself (no authentication is the only method), hands back a
`ConnectRequest` or a `Rejected`, and queues every byte to send in `data_to_send()`. The code
around it dials, then calls `accept(...)` or `refuse(code)`.

Every malformed or unsupported input becomes a `Rejected` with the reply the client is owed
(S3): a SOCKS4 client gets a SOCKS4 "rejected"; a greeting without the no-auth method gets
method 0xFF; a bad request gets a reply code (`COMMAND_NOT_SUPPORTED`,
`ADDRESS_TYPE_NOT_SUPPORTED`, `GENERAL_FAILURE`); a stream that is not SOCKS at all is closed
without a reply. No exception leaves `receive_data` for any input.

The client side (used by tests, benches and anything that dials through an endpoint) is a
few functions: `client_greeting`, `client_connect`, `parse_method_selection`, `parse_reply`.
"""

from __future__ import annotations

import ipaddress
import re
import struct
from dataclasses import dataclass
from enum import Enum, IntEnum

__all__ = [
    "MAX_DOMAIN",
    "NO_ACCEPTABLE_METHODS",
    "NO_AUTH",
    "VERSION",
    "AddressType",
    "Command",
    "ConnectRequest",
    "Rejected",
    "Reply",
    "ReplyCode",
    "ServerCodec",
    "SocksError",
    "State",
    "client_connect",
    "client_greeting",
    "encode_address",
    "parse_method_selection",
    "parse_reply",
]

VERSION = 5
NO_AUTH = 0x00
NO_ACCEPTABLE_METHODS = 0xFF
MAX_DOMAIN = 255
# Bytes a client may send after its request, before the reply (optimistic data): kept and
# forwarded once connected. The server stops reading while it dials, so this bounds nothing
# it does not already hold; the cap only guards a codec fed by other code.
MAX_EARLY_DATA = 1 << 20

_PORT = struct.Struct(">H")
# What a domain name in a request may contain: DNS labels (and an IP literal sent as a name).
_DOMAIN = re.compile(rb"[A-Za-z0-9_.:\-\[\]]+")


class ReplyCode(IntEnum):
    SUCCEEDED = 0x00
    GENERAL_FAILURE = 0x01
    NOT_ALLOWED = 0x02
    NETWORK_UNREACHABLE = 0x03
    HOST_UNREACHABLE = 0x04
    CONNECTION_REFUSED = 0x05
    TTL_EXPIRED = 0x06
    COMMAND_NOT_SUPPORTED = 0x07
    ADDRESS_TYPE_NOT_SUPPORTED = 0x08


class AddressType(IntEnum):
    IPV4 = 0x01
    DOMAIN = 0x03
    IPV6 = 0x04


class Command(IntEnum):
    CONNECT = 0x01
    BIND = 0x02
    UDP_ASSOCIATE = 0x03


class State(Enum):
    GREETING = "greeting"  # waiting for VER NMETHODS METHODS
    REQUEST = "request"  # waiting for VER CMD RSV ATYP DST.ADDR DST.PORT
    DIALING = "dialing"  # ConnectRequest handed out; accept() or refuse() next
    ESTABLISHED = "established"  # success sent: from here on the bytes are the payload's
    CLOSED = "closed"  # rejected or refused: send what is queued, then close


class SocksError(ValueError):
    """The other side sent something that is not SOCKS5 (client-side parsing)."""


@dataclass(frozen=True, slots=True)
class ConnectRequest:
    """The client asks for a TCP connection to host:port. `host` is an IP literal for
    IPV4 and IPV6, a name for DOMAIN."""

    host: str
    port: int
    address_type: AddressType


@dataclass(frozen=True, slots=True)
class Rejected:
    """The client's input was refused; what it is owed is queued in `data_to_send()`.
    `reply` is the SOCKS5 reply code sent, None when the refusal happened before a request
    (a method 0xFF, a SOCKS4 rejection, or nothing for a stream that is not SOCKS)."""

    reason: str
    reply: ReplyCode | None = None


@dataclass(frozen=True, slots=True)
class Reply:
    """A server's reply to CONNECT, as a client reads it."""

    code: int
    host: str
    port: int
    size: int  # bytes it took

    @property
    def succeeded(self) -> bool:
        return self.code == ReplyCode.SUCCEEDED


def encode_address(host: str, port: int) -> bytes:
    """ATYP DST.ADDR DST.PORT for an IP literal or a name."""
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        try:
            name = host.encode("ascii") if host.isascii() else host.encode("idna")
        except UnicodeError as exc:
            raise SocksError(f"{host!r} is not a valid domain name: {exc}") from None
        if not 0 < len(name) <= MAX_DOMAIN:
            raise SocksError(f"a domain name is 1 to {MAX_DOMAIN} bytes, not {len(name)}") from None
        return bytes([AddressType.DOMAIN, len(name)]) + name + _PORT.pack(port)
    atyp = AddressType.IPV4 if ip.version == 4 else AddressType.IPV6
    return bytes([atyp]) + ip.packed + _PORT.pack(port)


def _reply_bytes(code: ReplyCode, host: str = "0.0.0.0", port: int = 0) -> bytes:
    try:
        address = encode_address(host, port)
    except (SocksError, UnicodeError, struct.error):
        address = encode_address("0.0.0.0", 0)
    return bytes([VERSION, code, 0]) + address


class ServerCodec:
    """One client connection, server side. Not thread-safe; one per connection."""

    def __init__(self) -> None:
        self.state = State.GREETING
        self._buffer = bytearray()
        self._out = bytearray()
        self.request: ConnectRequest | None = None

    # -- input ------------------------------------------------------------------------------

    def receive_data(self, data: bytes) -> ConnectRequest | Rejected | None:
        """Feeds bytes from the client. Returns the next event, or None when more bytes are
        needed (or the input is payload held for later, or ignored after a refusal)."""
        if self.state is State.CLOSED:
            return None
        if self.state in (State.DIALING, State.ESTABLISHED):
            if len(self._buffer) + len(data) > MAX_EARLY_DATA:
                return self._reject("more data before the reply than the endpoint holds")
            self._buffer += data
            return None
        self._buffer += data
        if self.state is State.GREETING:
            rejected = self._greeting()
            if rejected is not None or self.state is State.GREETING:
                return rejected
        return self._request()

    def _reject(self, reason: str, reply: ReplyCode | None = None) -> Rejected:
        if reply is not None:
            self._out += _reply_bytes(reply)
        self.state = State.CLOSED
        self._buffer.clear()
        return Rejected(reason, reply)

    def _greeting(self) -> Rejected | None:
        buf = self._buffer
        if len(buf) < 1:
            return None
        if buf[0] == 4:
            # A SOCKS4 client: tell it in its own terms (VN 0, CD 91 "rejected").
            self._out += bytes([0, 91, 0, 0, 0, 0, 0, 0])
            return self._reject("a SOCKS4 request; this endpoint speaks SOCKS5 only")
        if buf[0] != VERSION:
            return self._reject(f"not SOCKS (first byte {buf[0]:#04x})")
        if len(buf) < 2:
            return None
        count = buf[1]
        if len(buf) < 2 + count:
            return None
        methods = bytes(buf[2 : 2 + count])
        del buf[: 2 + count]
        if NO_AUTH not in methods:
            self._out += bytes([VERSION, NO_ACCEPTABLE_METHODS])
            offered = ", ".join(f"{m:#04x}" for m in methods) or "none"
            return self._reject(f"no acceptable method: offered {offered}, only no-auth (0x00)")
        self._out += bytes([VERSION, NO_AUTH])
        self.state = State.REQUEST
        return None

    def _request(self) -> ConnectRequest | Rejected | None:
        buf = self._buffer
        if len(buf) < 4:
            return None
        version, command, reserved, atyp = buf[0], buf[1], buf[2], buf[3]
        if version != VERSION:
            return self._reject(f"request version {version}, not 5", ReplyCode.GENERAL_FAILURE)
        if command != Command.CONNECT:
            known = {c.value: c.name for c in Command}
            name = known.get(command, f"{command:#04x}")
            return self._reject(
                f"command {name} is not supported (CONNECT only)", ReplyCode.COMMAND_NOT_SUPPORTED
            )
        if reserved != 0:
            return self._reject(
                f"reserved byte is {reserved:#04x}, must be 0", ReplyCode.GENERAL_FAILURE
            )
        if atyp == AddressType.IPV4:
            end = 4 + 4
        elif atyp == AddressType.IPV6:
            end = 4 + 16
        elif atyp == AddressType.DOMAIN:
            if len(buf) < 5:
                return None
            if buf[4] == 0:
                return self._reject("empty domain name", ReplyCode.GENERAL_FAILURE)
            end = 5 + buf[4]
        else:
            return self._reject(
                f"address type {atyp:#04x} is not supported", ReplyCode.ADDRESS_TYPE_NOT_SUPPORTED
            )
        if len(buf) < end + 2:
            return None
        raw = bytes(buf[4:end])
        (port,) = _PORT.unpack_from(buf, end)
        del buf[: end + 2]
        if atyp == AddressType.IPV4:
            host = str(ipaddress.IPv4Address(raw))
        elif atyp == AddressType.IPV6:
            host = str(ipaddress.IPv6Address(raw))
        else:
            label = raw[1:]
            if _DOMAIN.fullmatch(label) is None:
                return self._reject("invalid domain name", ReplyCode.GENERAL_FAILURE)
            host = label.decode("ascii")
        self.request = ConnectRequest(host, port, AddressType(atyp))
        self.state = State.DIALING
        return self.request

    # -- output -----------------------------------------------------------------------------

    def accept(self, bound_host: str = "0.0.0.0", bound_port: int = 0) -> None:
        """The connection to the destination is up: queue the success reply (BND.ADDR and
        BND.PORT are the endpoint's side of it)."""
        if self.state is not State.DIALING:
            raise RuntimeError(f"accept() in state {self.state.value}")
        self._out += _reply_bytes(ReplyCode.SUCCEEDED, bound_host, bound_port)
        self.state = State.ESTABLISHED

    def refuse(self, code: ReplyCode) -> None:
        """The destination could not be reached: queue the failure reply."""
        if self.state is not State.DIALING:
            raise RuntimeError(f"refuse() in state {self.state.value}")
        if code == ReplyCode.SUCCEEDED:
            raise ValueError("refuse() needs a failure code")
        self._out += _reply_bytes(code)
        self.state = State.CLOSED
        self._buffer.clear()

    def data_to_send(self) -> bytes:
        """Bytes owed to the client since the last call."""
        out = bytes(self._out)
        self._out.clear()
        return out

    def take_early_data(self) -> bytes:
        """Payload the client sent behind its request (to forward once connected)."""
        data = bytes(self._buffer) if self.state is State.ESTABLISHED else b""
        self._buffer.clear()
        return data


# -- client side ------------------------------------------------------------------------------


def client_greeting(methods: bytes = bytes([NO_AUTH])) -> bytes:
    return bytes([VERSION, len(methods)]) + methods


def client_connect(host: str, port: int) -> bytes:
    return bytes([VERSION, Command.CONNECT, 0]) + encode_address(host, port)


def parse_method_selection(data: bytes) -> int | None:
    """The method the server chose (NO_ACCEPTABLE_METHODS included); None if incomplete."""
    if len(data) < 2:
        return None
    if data[0] != VERSION:
        raise SocksError(f"method selection version {data[0]}, not 5")
    return data[1]


def parse_reply(data: bytes) -> Reply | None:
    """A CONNECT reply from the start of data; None if incomplete."""
    if len(data) < 4:
        return None
    if data[0] != VERSION:
        raise SocksError(f"reply version {data[0]}, not 5")
    atyp = data[3]
    if atyp == AddressType.IPV4:
        end = 8
    elif atyp == AddressType.IPV6:
        end = 20
    elif atyp == AddressType.DOMAIN:
        if len(data) < 5:
            return None
        end = 5 + data[4]
    else:
        raise SocksError(f"reply address type {atyp:#04x}")
    if len(data) < end + 2:
        return None
    raw = data[4:end]
    if atyp == AddressType.IPV4:
        host = str(ipaddress.IPv4Address(raw))
    elif atyp == AddressType.IPV6:
        host = str(ipaddress.IPv6Address(raw))
    else:
        host = raw[1:].decode("ascii", "replace")
    (port,) = _PORT.unpack_from(data, end)
    return Reply(data[1], host, port, end + 2)

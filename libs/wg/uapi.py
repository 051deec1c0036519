"""The WireGuard cross-platform configuration protocol (UAPI), as wireguard-go and the
kernel's `wg` speak it on /var/run/wireguard/<device>.sock: text lines `key=value`, a `set=1`
or `get=1` request ended by an empty line, answered by lines and `errno=N`.

Sans-I/O: this renders requests and parses answers; the socket is the caller's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from libs.wg.keys import check_key


class UapiError(Exception):
    """The device refused a request (its errno) or answered something unreadable."""

    def __init__(self, message: str, errno: int = 0) -> None:
        super().__init__(message)
        self.errno = errno


@dataclass(frozen=True)
class PeerConfig:
    public_key: bytes
    allowed_ips: tuple[str, ...] = ()
    endpoint: str | None = None  # "host:port"; None leaves it as it is
    persistent_keepalive: int | None = None  # seconds; 0 turns it off
    remove: bool = False


@dataclass(frozen=True)
class DeviceConfig:
    private_key: bytes | None = None
    listen_port: int | None = None
    replace_peers: bool = False  # drop every peer not listed here
    peers: tuple[PeerConfig, ...] = ()


@dataclass
class PeerState:
    public_key: bytes
    endpoint: str | None = None
    allowed_ips: list[str] = field(default_factory=list)
    last_handshake: float = 0.0  # seconds since the epoch; 0: never
    rx_bytes: int = 0
    tx_bytes: int = 0
    persistent_keepalive: int = 0


@dataclass
class DeviceState:
    listen_port: int = 0
    peers: dict[bytes, PeerState] = field(default_factory=dict)


def render_set(config: DeviceConfig) -> bytes:
    lines = ["set=1"]
    if config.private_key is not None:
        check_key(config.private_key, "private key")
        lines.append(f"private_key={config.private_key.hex()}")
    if config.listen_port is not None:
        lines.append(f"listen_port={config.listen_port}")
    if config.replace_peers:
        lines.append("replace_peers=true")
    for peer in config.peers:
        check_key(peer.public_key, "peer public key")
        lines.append(f"public_key={peer.public_key.hex()}")
        if peer.remove:
            lines.append("remove=true")
            continue
        if peer.endpoint is not None:
            lines.append(f"endpoint={peer.endpoint}")
        if peer.persistent_keepalive is not None:
            lines.append(f"persistent_keepalive_interval={peer.persistent_keepalive}")
        if peer.allowed_ips:
            lines.append("replace_allowed_ips=true")
            lines.extend(f"allowed_ip={ip}" for ip in peer.allowed_ips)
    return ("\n".join(lines) + "\n\n").encode()


GET = b"get=1\n\n"


def answer_complete(data: bytes) -> bool:
    """An answer ends with `errno=N` and an empty line."""
    return data.endswith(b"\n\n") and b"errno=" in data


def parse_errno(data: bytes) -> None:
    """Raise when a `set` answer carries an error."""
    for line in data.decode(errors="replace").splitlines():
        if line.startswith("errno="):
            errno = int(line[6:] or 0)
            if errno:
                raise UapiError(
                    f"the WireGuard device refused the configuration (errno {errno})", errno
                )
            return
    raise UapiError(f"no errno in the device's answer: {data[:200]!r}")


def parse_get(data: bytes) -> DeviceState:
    parse_errno(data)
    state = DeviceState()
    peer: PeerState | None = None
    seconds = nanos = 0
    for line in data.decode(errors="replace").splitlines():
        key, sep, value = line.partition("=")
        if not sep:
            continue
        if key == "listen_port":
            state.listen_port = int(value)
        elif key == "public_key":
            peer = PeerState(public_key=bytes.fromhex(value))
            state.peers[peer.public_key] = peer
            seconds = nanos = 0
        elif peer is None:
            continue
        elif key == "endpoint":
            peer.endpoint = value
        elif key == "allowed_ip":
            peer.allowed_ips.append(value)
        elif key == "last_handshake_time_sec":
            seconds = int(value)
            peer.last_handshake = seconds + nanos / 1e9
        elif key == "last_handshake_time_nsec":
            nanos = int(value)
            peer.last_handshake = seconds + nanos / 1e9
        elif key == "rx_bytes":
            peer.rx_bytes = int(value)
        elif key == "tx_bytes":
            peer.tx_bytes = int(value)
        elif key == "persistent_keepalive_interval":
            peer.persistent_keepalive = int(value)
    return state

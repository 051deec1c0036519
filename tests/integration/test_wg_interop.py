"""libs.wg against a real WireGuard: Debian's `wireguard-go` on a tun device `nodus0`.

Each test makes a network namespace with its own mount namespace (a tmpfs on
/var/run/wireguard, so the control socket of one `nodus0` never meets another's), starts
wireguard-go in it, configures it with `wg`, and gives `nodus0` the address 10.77.0.1/24.
The Python side is a UDP socket on the namespace's loopback (created by a thread that joins
the namespace), and a `Device` with IP framing, since wireguard-go carries IP packets:

- Python initiates, sends ICMP echo requests to 10.77.0.1; the namespace's kernel answers
  and the replies come back through wireguard-go and decrypt.
- wireguard-go initiates, when a UDP socket inside the namespace sends a datagram to
  10.77.0.2 (our address on the tunnel); Python answers with a UDP datagram that the
  namespace socket receives.
- wireguard-go under load (a burst of junk initiations fills its handshake queue) answers our
  initiation with a cookie reply; Python keeps the cookie, and its retransmission, carrying
  mac2, is answered with a response.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import shutil
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import pytest

from libs.wg import (
    IP_PACKETS,
    Delivered,
    Device,
    Event,
    HandshakeCompleted,
    Outgoing,
    generate_preshared_key,
    generate_private_key,
    key_to_base64,
    message_type,
    public_key,
)
from libs.wg.constants import LABEL_MAC1
from libs.wg.crypto import hash_, mac

pytestmark = [pytest.mark.slow]

TUNNEL_ADDRESS = "10.77.0.1"  # nodus0, inside the namespace
PYTHON_ADDRESS = "10.77.0.2"  # the Python peer's address on the tunnel
WG_PORT = 51820
TOOLS = ("ip", "wireguard-go", "wg", "unshare", "nsenter")
CLONE_NEWNET = 0x40000000
T = TypeVar("T")


def _run(*args: str, timeout: float = 10.0) -> str:
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


def _netns_skip_reason() -> str | None:
    if os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    probe = f"nodus-wg-probe-{secrets.token_hex(3)}"
    try:
        _run("ip", "netns", "add", probe)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as error:
        return f"`ip netns` is impossible here: {error}"
    with contextlib.suppress(Exception):
        _run("ip", "netns", "del", probe)
    return None


_SKIP = _netns_skip_reason()
if _SKIP is not None:
    pytestmark.append(pytest.mark.skip(reason=_SKIP))


def _in_netns(name: str, make: Callable[[], T]) -> T:
    """Run `make` on a thread that joined the namespace: a socket it creates stays there."""
    result: list[T] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns")
            finally:
                os.close(fd)
            result.append(make())
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(10)
    if errors:
        raise errors[0]
    if not result:
        raise RuntimeError("joining the namespace timed out")
    return result[0]


@dataclass
class WireguardGo:
    """wireguard-go serving `nodus0` in its own network and mount namespaces."""

    namespace: str
    process: subprocess.Popen[bytes]
    private_key: bytes = field(default_factory=generate_private_key)

    @property
    def public_key(self) -> bytes:
        return public_key(self.private_key)

    def wg(self, *args: str) -> str:
        return _run("nsenter", "-t", str(self.process.pid), "-m", "-n", "wg", *args)

    def udp_socket(self) -> socket.socket:
        return _in_netns(self.namespace, lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM))


@pytest.fixture
def wireguard_go(tmp_path: Path) -> Iterator[WireguardGo]:
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"missing {missing}: run deploy/dev/system-deps.sh (make test does)")
    namespace = f"nodus-wg-{os.getpid()}-{secrets.token_hex(3)}"
    _run("ip", "netns", "add", namespace)
    process: subprocess.Popen[bytes] | None = None
    log = tmp_path / "wireguard-go.log"
    try:
        _run("ip", "-n", namespace, "link", "set", "lo", "up")
        env = dict(os.environ, WG_I_PREFER_BUGGY_USERSPACE_TO_POLISHED_KMOD="1", LOG_LEVEL="debug")
        command = ["ip", "netns", "exec", namespace, "unshare", "-m", "--propagation", "private"]
        script = (
            "mkdir -p /var/run/wireguard && mount -t tmpfs tmpfs /var/run/wireguard"
            " && exec wireguard-go -f nodus0"
        )
        with log.open("wb") as out:
            process = subprocess.Popen(
                [*command, "sh", "-c", script],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )
        peer = WireguardGo(namespace, process)
        deadline = time.monotonic() + 10
        while True:
            try:
                peer.wg("show", "nodus0")
                break
            except RuntimeError:
                if process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"wireguard-go did not start: {log.read_text()}") from None
                time.sleep(0.05)
        key_file = tmp_path / "wg.key"
        key_file.write_text(key_to_base64(peer.private_key))
        peer.wg("set", "nodus0", "listen-port", str(WG_PORT), "private-key", str(key_file))
        _run("ip", "-n", namespace, "addr", "add", f"{TUNNEL_ADDRESS}/24", "dev", "nodus0")
        _run("ip", "-n", namespace, "link", "set", "nodus0", "up")
        yield peer
    finally:
        if process is not None:
            process.terminate()
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)
        with contextlib.suppress(Exception):
            _run("ip", "netns", "del", namespace)


class PythonPeer:
    """A Device on a UDP socket: the I/O loop a tunnel would run, kept minimal."""

    def __init__(self, device: Device, sock: socket.socket, remote: tuple[str, int]) -> None:
        self.device = device
        self.sock = sock
        self.remote = remote
        self.events: list[Event] = []

    def send(self, peer: bytes, payload: bytes) -> None:
        self.transmit(self.device.send(peer, payload, time.monotonic()))

    def transmit(self, events: list[Event] | list[Outgoing]) -> None:
        for event in events:
            if isinstance(event, Outgoing):
                self.sock.sendto(event.data, self.remote)
            else:
                self.events.append(event)

    def wait_for(self, wanted: Callable[[Event], bool], timeout: float = 10.0) -> Event:
        deadline = time.monotonic() + timeout
        while True:
            for event in self.events:
                if wanted(event):
                    self.events.remove(event)
                    return event
            now = time.monotonic()
            if now > deadline:
                raise AssertionError(f"timed out; events so far: {self.events!r}")
            next_tick = self.device.next_deadline()
            wait = deadline - now if next_tick is None else min(deadline - now, next_tick - now)
            self.sock.settimeout(max(wait, 0.001))
            try:
                data, address = self.sock.recvfrom(70_000)
            except TimeoutError:
                self.transmit(self.device.tick(time.monotonic()))
                continue
            self.remote = address  # like WireGuard, answer where the peer last spoke from
            source = socket.inet_aton(address[0]) + address[1].to_bytes(2, "big")
            self.transmit(self.device.receive(data, time.monotonic(), source))
            self.transmit(self.device.tick(time.monotonic()))


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total: int = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def _ipv4(source: str, destination: str, protocol: int, payload: bytes) -> bytes:
    header = struct.pack(
        "!BBHHHBBH4s4s",
        0x45,
        0,
        20 + len(payload),
        secrets.randbits(16),
        0x4000,
        64,
        protocol,
        0,
        socket.inet_aton(source),
        socket.inet_aton(destination),
    )
    checksum = _checksum(header)
    return header[:10] + struct.pack("!H", checksum) + header[12:] + payload


def _icmp_echo(ident: int, sequence: int, data: bytes) -> bytes:
    message = struct.pack("!BBHHH", 8, 0, 0, ident, sequence) + data
    return message[:2] + struct.pack("!H", _checksum(message)) + message[4:]


def _udp(source_port: int, destination_port: int, data: bytes) -> bytes:
    return struct.pack("!HHHH", source_port, destination_port, 8 + len(data), 0) + data


def _parse_ipv4(packet: bytes) -> tuple[str, str, int, bytes]:
    assert packet[0] >> 4 == 4, packet[:20].hex()
    header_length = (packet[0] & 0x0F) * 4
    (total,) = struct.unpack_from("!H", packet, 2)
    assert total == len(packet), "IP framing must strip the padding exactly"
    assert _checksum(packet[:header_length]) == 0
    return (
        socket.inet_ntoa(packet[12:16]),
        socket.inet_ntoa(packet[16:20]),
        packet[9],
        packet[header_length:total],
    )


def _python_peer(
    wireguard_go: WireguardGo, preshared_key: bytes | None
) -> tuple[PythonPeer, Device]:
    device = Device(generate_private_key(), framing=IP_PACKETS)
    device.add_peer(wireguard_go.public_key, preshared_key)
    sock = _in_netns(
        wireguard_go.namespace, lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    )
    sock.bind(("127.0.0.1", 0))
    return PythonPeer(device, sock, ("127.0.0.1", WG_PORT)), device


def _configure_peer(
    wireguard_go: WireguardGo,
    device: Device,
    tmp_path: Path,
    preshared_key: bytes | None,
    endpoint: tuple[str, int] | None = None,
) -> None:
    args = ["set", "nodus0", "peer", key_to_base64(device.public_key)]
    args += ["allowed-ips", f"{PYTHON_ADDRESS}/32"]
    if preshared_key is not None:
        psk_file = tmp_path / "psk"
        psk_file.write_text(key_to_base64(preshared_key))
        args += ["preshared-key", str(psk_file)]
    if endpoint is not None:
        args += ["endpoint", f"{endpoint[0]}:{endpoint[1]}"]
    wireguard_go.wg(*args)


def test_python_initiates_and_pings_through_wireguard_go(
    wireguard_go: WireguardGo, tmp_path: Path
) -> None:
    preshared_key = generate_preshared_key()
    python, device = _python_peer(wireguard_go, preshared_key)
    _configure_peer(wireguard_go, device, tmp_path, preshared_key)
    remote = wireguard_go.public_key
    try:
        ident = secrets.randbits(16)
        for sequence, size in enumerate((56, 1000, 1372, 0)):
            data = secrets.token_bytes(size)
            request = _ipv4(PYTHON_ADDRESS, TUNNEL_ADDRESS, 1, _icmp_echo(ident, sequence, data))
            python.send(remote, request)
            if sequence == 0:
                completed = python.wait_for(lambda e: isinstance(e, HandshakeCompleted))
                assert completed == HandshakeCompleted(remote, initiator=True)
            reply = python.wait_for(lambda e: isinstance(e, Delivered))
            assert isinstance(reply, Delivered) and reply.peer == remote
            source, destination, protocol, icmp = _parse_ipv4(bytes(reply.payload))
            assert (source, destination, protocol) == (TUNNEL_ADDRESS, PYTHON_ADDRESS, 1)
            assert icmp[0] == 0 and _checksum(icmp) == 0  # echo reply
            assert struct.unpack_from("!HH", icmp, 4) == (ident, sequence)
            assert icmp[8:] == data
        handshakes = wireguard_go.wg("show", "nodus0", "latest-handshakes").split()
        assert handshakes[0] == key_to_base64(device.public_key) and int(handshakes[1]) > 0
        received = int(wireguard_go.wg("show", "nodus0", "transfer").split()[1])
        assert received > 0

        # Keepalives both ways: ours counts 32 bytes there; theirs (persistent keepalive)
        # opens here to nothing at all.
        python.send(remote, b"")
        deadline = time.monotonic() + 5
        while int(wireguard_go.wg("show", "nodus0", "transfer").split()[1]) != received + 32:
            assert time.monotonic() < deadline, "wireguard-go did not count our keepalive"
            time.sleep(0.02)
        wireguard_go.wg(
            "set", "nodus0", "peer", key_to_base64(device.public_key), "persistent-keepalive", "1"
        )
        python.sock.settimeout(5)
        keepalive, _ = python.sock.recvfrom(2048)
        assert len(keepalive) == 32 and device.receive(keepalive, time.monotonic()) == []
        assert not device.drops, device.drops
    finally:
        python.sock.close()


def test_wireguard_go_initiates_and_python_answers(
    wireguard_go: WireguardGo, tmp_path: Path
) -> None:
    python, device = _python_peer(wireguard_go, None)
    _configure_peer(wireguard_go, device, tmp_path, None, python.sock.getsockname())
    inside = wireguard_go.udp_socket()
    remote = wireguard_go.public_key
    try:
        inside.bind((TUNNEL_ADDRESS, 0))
        inside.settimeout(10)
        inside_port = inside.getsockname()[1]
        greeting = b"from the namespace " + secrets.token_bytes(16)
        inside.sendto(greeting, (PYTHON_ADDRESS, 7777))  # wireguard-go starts the handshake

        delivered = python.wait_for(lambda e: isinstance(e, Delivered))
        assert isinstance(delivered, Delivered) and delivered.peer == remote
        completed = python.wait_for(lambda e: isinstance(e, HandshakeCompleted))
        assert completed == HandshakeCompleted(remote, initiator=False)
        source, destination, protocol, datagram = _parse_ipv4(bytes(delivered.payload))
        assert (source, destination, protocol) == (TUNNEL_ADDRESS, PYTHON_ADDRESS, 17)
        assert struct.unpack_from("!HH", datagram) == (inside_port, 7777)
        assert datagram[8:] == greeting

        for round_trip in range(3):
            answer = b"from python %d " % round_trip + secrets.token_bytes(600 * round_trip)
            packet = _ipv4(PYTHON_ADDRESS, TUNNEL_ADDRESS, 17, _udp(7777, inside_port, answer))
            python.send(remote, packet)
            received, sender = inside.recvfrom(65_535)
            assert received == answer and sender == (PYTHON_ADDRESS, 7777)
        assert not device.drops, device.drops
    finally:
        inside.close()
        python.sock.close()


def _junk_initiations(responder: bytes, count: int) -> list[bytes]:
    """Initiations with a valid mac1 and nothing else valid: each costs wireguard-go a
    Diffie-Hellman before it fails, so a burst fills its handshake queue (its load signal)."""
    mac1_key = hash_(LABEL_MAC1, responder)
    junk = []
    for _ in range(count):
        body = b"\x01\0\0\0" + secrets.token_bytes(112)
        junk.append(body + mac(mac1_key, body) + bytes(16))
    return junk


def _flood(sock: socket.socket, junk: list[bytes]) -> None:
    """Fill wireguard-go's handshake queue, then give it a moment to drain what it can: it
    stays under load for a second after its queue was last seen long."""
    for message in junk:
        sock.sendto(message, ("127.0.0.1", WG_PORT))
    time.sleep(0.2)


def test_wireguard_go_under_load_answers_with_a_cookie_and_accepts_mac2(
    wireguard_go: WireguardGo, tmp_path: Path
) -> None:
    junk = _junk_initiations(wireguard_go.public_key, 4000)
    flood = wireguard_go.udp_socket()
    remote = wireguard_go.public_key
    try:
        for _attempt in range(5):
            python, device = _python_peer(wireguard_go, None)
            _configure_peer(wireguard_go, device, tmp_path, None)
            cookies = device.peers[remote].cookies
            try:
                _flood(flood, junk)
                now = time.monotonic()
                [initiation] = device.initiate_handshake(remote, now)
                python.sock.sendto(initiation.data, python.remote)
                python.sock.settimeout(2.0)
                try:
                    reply, _ = python.sock.recvfrom(2048)
                except TimeoutError:
                    continue  # lost in the flood: try again
                if message_type(reply) != 3:
                    continue  # not loaded enough to refuse us: flood again
                assert device.receive(reply, now) == []  # the cookie decrypts and is kept
                assert cookies.has_cookie

                _flood(flood, junk)
                [retry] = device.tick(now + 6.0)  # our clock: the retransmission is due
                assert isinstance(retry, Outgoing) and retry.data[-16:] != bytes(16)  # mac2
                python.sock.sendto(retry.data, python.remote)
                try:
                    answer, _ = python.sock.recvfrom(2048)
                except TimeoutError:
                    continue  # lost in the flood: try again
                assert message_type(answer) == 2, "wireguard-go refused our mac2"
                events = device.receive(answer, now + 6.0)
                assert events[0] == HandshakeCompleted(remote, initiator=True)
                # Its log: one cookie for our first initiation, none for the retry.
                port = python.sock.getsockname()[1]
                log = (tmp_path / "wireguard-go.log").read_text(errors="replace")
                ours = [line for line in log.splitlines() if f"127.0.0.1:{port}" in line]
                assert sum("cookie" in line for line in ours) == 1, ours
                return
            finally:
                python.sock.close()
        pytest.fail("wireguard-go never came under load")
    finally:
        flood.close()

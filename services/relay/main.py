"""`nodus relay`: a standalone relay daemon."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
from pathlib import Path

from libs.bus import Bus
from libs.contracts import names
from libs.contracts.errors import ErrorCode, NodusError
from libs.relayproto.connection import split_address
from libs.runtime import add_common_flags, run_daemon
from services.relay.relay import Relay


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "A relay for Relayed gangs: members connect with their epoch's credentials and the "
        "relay forwards WireGuard ciphertext between members of one gang epoch, meshed one "
        "hop with the other relays, at most 1 Gbit/s per gang, metering the bytes for billing. "
        "Logs are JSON lines on stderr (journald-friendly); SIGTERM flushes usage and stops."
    )
    add_common_flags(parser, metrics_port=0)
    parser.add_argument(
        "--name",
        default=socket.gethostname().split(".")[0].lower(),
        help="relay name (default: hostname)",
    )
    parser.add_argument(
        "--region",
        required=True,
        help="the provider region (us-east-1) or region class (us) whose machines this relay"
        " serves first; shown as derp:<region> in probes",
    )
    parser.add_argument(
        "--listen", default="0.0.0.0:4430", help="HOST:PORT for members and mesh peers"
    )
    parser.add_argument("--advertise", help="host members dial (default: the listen host)")
    parser.add_argument(
        "--mesh-with", default="", help="comma-separated HOST:PORT of the other relays"
    )
    parser.add_argument(
        "--mesh-key-file",
        type=Path,
        required=True,
        help="file holding the shared mesh secret (at least 32 bytes); same on every relay",
    )
    parser.add_argument(
        "--key-file",
        type=Path,
        help="this relay's X25519 private key (32 raw bytes); created if missing",
    )
    parser.add_argument(
        "--usage-journal",
        type=Path,
        default=Path(os.environ.get("STATE_DIRECTORY", "/var/lib/nodus/relay")) / "usage.journal",
        help="file where metered bytes are kept until published, so a killed relay loses no "
        "billing: it publishes them when it starts again (default: $STATE_DIRECTORY/"
        "usage.journal, else /var/lib/nodus/relay/usage.journal)",
    )
    parser.add_argument(
        "--stun-port",
        type=int,
        default=os.environ.get("NODUS_RELAY_STUN_PORT") or None,
        help="answer STUN on this UDP port of the listen host, so Direct members behind NAT "
        "learn their public address (ICE, G11); the host's relays of one user may all answer "
        "on one port; off when not given (env NODUS_RELAY_STUN_PORT)",
    )
    shared = os.environ.get("NODUS_RELAY_SHARE_PORT", "")
    parser.add_argument(
        "--share-port",
        type=int,
        default=shared or None,  # a string default is parsed as the flag would be
        help="also take members on this TCP port of the listen host, shared with the host's "
        "other relays (443: members behind a firewall that opens only 443 reach each of them; "
        "a member is handed to the relay it names). Not the --listen port, which mesh peers "
        "dial. Every relay sharing it runs as one user. Give it once every agent and placer "
        "runs this version: older ones cannot read the record (env NODUS_RELAY_SHARE_PORT)",
    )
    parser.add_argument(
        "--no-rate-limit", action="store_true", help="benchmarks only: no per-gang cap"
    )


def _read_secret(path: Path, what: str, size: int | None = None) -> bytes:
    """A text secret (surrounding whitespace dropped), or exactly `size` raw bytes, kept whole:
    a random key may begin or end with a byte that looks like whitespace."""
    try:
        data = path.read_bytes()
        if size is None:
            data = data.strip()
    except OSError as error:
        raise NodusError(ErrorCode.INVALID, f"{what} {path}: {error.strerror}") from None
    if size is not None and len(data) != size:
        raise NodusError(
            ErrorCode.INVALID, f"{what} {path}: expected {size} bytes, found {len(data)}"
        )
    if len(data) < 32:
        raise NodusError(ErrorCode.INVALID, f"{what} {path}: at least 32 bytes of secret needed")
    return data


def _create_key(path: Path) -> None:
    """A new private key, readable by the relay alone from its first byte."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as error:
        raise NodusError(ErrorCode.INVALID, f"relay key {path}: {error.strerror}") from None
    with os.fdopen(fd, "wb") as handle:
        handle.write(os.urandom(32))


async def _body(args: argparse.Namespace, stop: asyncio.Event) -> None:
    mesh_key = _read_secret(args.mesh_key_file, "mesh key")
    private_key = None
    if args.key_file:
        if not args.key_file.exists():
            _create_key(args.key_file)
        private_key = _read_secret(args.key_file, "relay key", 32)
    host, port = split_address(args.listen)
    if args.share_port is not None and args.share_port == port:
        raise NodusError(
            ErrorCode.INVALID,
            f"--share-port {port} is the --listen port: mesh peers dial the listen port and "
            "must reach this relay, not any relay of the host; give the relay a port of its own",
        )
    bus = await Bus.open(
        args.nats,
        name=f"nodus-relay-{args.name}",
        credentials=args.credentials,
        buckets=[names.BUCKET_MEMBERS, names.BUCKET_EPOCHS, names.BUCKET_RELAYS],
        streams=True,
    )
    try:
        relay = Relay(
            bus,
            args.name,
            args.region,
            (host, port),
            [a for a in args.mesh_with.split(",") if a],
            mesh_key,
            private_key=private_key,
            rate_limit=not args.no_rate_limit,
            advertise=args.advertise,
            usage_journal=args.usage_journal,
            stun_port=args.stun_port,
            share_port=args.share_port,
        )
    except (OSError, ValueError) as error:
        await bus.close()
        raise NodusError(
            ErrorCode.INVALID, f"usage journal {args.usage_journal}: {error}"
        ) from None
    try:
        await relay.start()
        relay.failed.add_done_callback(lambda _: stop.set())
        await stop.wait()
        if relay.failed.done():
            relay.failed.result()  # raises: another relay took this relay's name
    finally:
        await relay.stop()
        await bus.close()


def run(args: argparse.Namespace) -> int:
    return run_daemon("relay", args, _body)

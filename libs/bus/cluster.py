"""A real bus for real machines (S1, `nodus bus init`): a three-node NATS cluster with TLS
on clients and routes, JetStream replicated 3 ways, and one NKey user per process.

`plan_cluster` is pure (what each server is); `write_cluster` writes a directory an operator
copies to the servers: a certificate authority, each server's certificate and configuration,
and the users with their seeds. The users' block is a file of its own (`authorization.conf`),
included by every server: adding an agent rewrites it, and `nats-server --signal reload`
admits it without a restart.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from libs.bus.auth import AGENT, MONITOR, OPERATOR, RELAY, SERVICE
from libs.bus.credentials import BusUsers, write_secret
from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.names import NATS_PORT

SERVICES = ("placer", "runner", "remediator", "monitor")
# The runner's user under its old name, so credentials issued before it was renamed still
# work; made until the next release.
OLD_SERVICE_USERS = ("prober",)
CERT_DAYS = 825  # what browsers and most TLS stacks accept for a leaf


@dataclass(frozen=True, slots=True)
class ServerSpec:
    name: str
    host: str  # what clients and the other servers dial; also the certificate's name
    client_port: int = NATS_PORT
    cluster_port: int = 6222


def parse_server(text: str) -> ServerSpec:
    """`NAME=HOST[:CLIENT_PORT[:CLUSTER_PORT]]`."""
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise NodusError(ErrorCode.INVALID, f"--server {text!r}: NAME=HOST[:PORT[:ROUTE_PORT]]")
    host, *ports = rest.split(":")
    try:
        numbers = [int(p) for p in ports]
    except ValueError:
        raise NodusError(ErrorCode.INVALID, f"--server {text!r}: ports are numbers") from None
    if len(numbers) > 2 or any(not 0 < p < 65536 for p in numbers):
        raise NodusError(ErrorCode.INVALID, f"--server {text!r}: NAME=HOST[:PORT[:ROUTE_PORT]]")
    return ServerSpec(name, host, *numbers)


def server_config(
    server: ServerSpec,
    every: list[ServerSpec],
    installed_at: Path,
    store_dir: Path,
    listen_host: str = "0.0.0.0",
) -> str:
    """One server's configuration, in NATS's own syntax (JSON values are valid in it)."""
    tls = {
        "cert_file": str(installed_at / "server.pem"),
        "key_file": str(installed_at / "server-key.pem"),
        "ca_file": str(installed_at / "ca.pem"),
        "timeout": 2,
    }
    routes = [f"nats-route://{s.host}:{s.cluster_port}" for s in every if s != server]
    lines = [
        "# Written by `nodus bus init`: one server of the Nodus bus (deploy/nats/README.md).",
        f"server_name: {json.dumps(server.name)}",
        f"listen: {json.dumps(f'{listen_host}:{server.client_port}')}",
        # Clients must speak TLS; they verify the server against the bus's own authority.
        f"tls: {json.dumps(tls)}",
        f"jetstream: {json.dumps({'store_dir': str(store_dir)})}",
        # Routes are TLS both ways: a server proves itself with its certificate.
        "cluster: "
        + json.dumps(
            {
                "name": "nodus",
                "listen": f"{listen_host}:{server.cluster_port}",
                "routes": routes,
                "tls": {**tls, "verify": True},
            }
        ),
        "include authorization.conf  # beside this file: `nodus bus user` rewrites it",
        "",
    ]
    return "\n".join(lines)


def authorization_conf(users: BusUsers) -> str:
    return "authorization: " + json.dumps(users.authorization(), indent=1) + "\n"


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _pem_key(key: ec.EllipticCurvePrivateKey) -> str:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()


def _pem_cert(cert: x509.Certificate) -> str:
    return cert.public_bytes(serialization.Encoding.PEM).decode()


def new_authority(now: datetime.datetime) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = _key()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "Nodus bus authority")])
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return key, cert


def server_certificate(
    server: ServerSpec,
    authority: tuple[ec.EllipticCurvePrivateKey, x509.Certificate],
    now: datetime.datetime,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """For clients (server auth) and for the routes, where it also proves itself (client
    auth)."""
    ca_key, ca_cert = authority
    key = _key()
    try:
        alt: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(server.host))
    except ValueError:
        alt = x509.DNSName(server.host)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, server.name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=CERT_DAYS))
        .add_extension(x509.SubjectAlternativeName([alt]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def write_cluster(
    directory: Path,
    servers: list[ServerSpec],
    relays: list[str],
    agents: list[str],
    installed_at: Path | None = None,
    store_dir: Path = Path("/var/lib/nats"),
    listen_host: str = "0.0.0.0",
) -> BusUsers:
    """DIR/ca.pem; DIR/servers/NAME/{nats-server.conf, server.pem, server-key.pem, ca.pem,
    authorization.conf}; DIR/users/{users.json, NAME.nk}. `installed_at` is where a server's
    files will be (/etc/nats); None: where they are written (a test on one machine)."""
    if len(servers) < 3 or len({s.name for s in servers}) != len(servers):
        raise NodusError(
            ErrorCode.INVALID, "a clustered bus has at least 3 servers with distinct names"
        )
    if (directory / "ca.pem").exists():
        raise NodusError(
            ErrorCode.ALREADY_EXISTS,
            f"{directory} holds a bus already; add users with `nodus bus user --dir {directory}`",
        )
    now = datetime.datetime.now(datetime.UTC)
    authority = new_authority(now)
    directory.mkdir(parents=True, exist_ok=True)
    write_secret(directory / "ca-key.pem", _pem_key(authority[0]))
    (directory / "ca.pem").write_text(_pem_cert(authority[1]))
    users = BusUsers(directory / "users")
    users.ensure("operator", OPERATOR)
    for service in SERVICES + OLD_SERVICE_USERS:
        users.ensure(service, SERVICE)
    for relay in relays:
        users.ensure(f"relay-{relay}", RELAY, relay)
    for node in agents:
        ensure_machine(users, node)
    for server in servers:
        home = directory / "servers" / server.name
        home.mkdir(parents=True, exist_ok=True)
        key, cert = server_certificate(server, authority, now)
        write_secret(home / "server-key.pem", _pem_key(key))
        (home / "server.pem").write_text(_pem_cert(cert))
        (home / "ca.pem").write_text(_pem_cert(authority[1]))
        where = installed_at or home.resolve()
        store = store_dir if installed_at else home.resolve() / "jetstream"
        (home / "nats-server.conf").write_text(
            server_config(server, servers, where, store, listen_host)
        )
    write_authorization(directory, users)
    return users


def write_authorization(directory: Path, users: BusUsers) -> None:
    """Every server's copy of the users (public keys and permissions only)."""
    text = authorization_conf(users)
    for home in sorted((directory / "servers").iterdir()):
        partial = home / "authorization.conf.tmp"
        partial.write_text(text)
        partial.replace(home / "authorization.conf")


def ensure_machine(users: BusUsers, node: str) -> list[Path]:
    """A GPU machine's two users, each confined to the machine: its agent's and its
    monitor's (both run on it, beside users' workloads). Their seeds, agent's first."""
    return [
        users.ensure(f"agent-{node}", AGENT, node),
        users.ensure(f"monitor-{node}", MONITOR, node),
    ]


def _users(directory: Path) -> BusUsers:
    if not (directory / "ca.pem").exists():
        raise NodusError(ErrorCode.NOT_FOUND, f"{directory} holds no bus: `nodus bus init` first")
    return BusUsers(directory / "users")


def add_user(directory: Path, name: str, role: str, node: str | None) -> Path:
    users = _users(directory)
    seed = users.ensure(name, role, node)
    write_authorization(directory, users)
    return seed


def add_machine(directory: Path, node: str) -> list[Path]:
    """A new machine's agent and monitor users (a machine that has them gets its monitor's)."""
    users = _users(directory)
    seeds = ensure_machine(users, node)
    write_authorization(directory, users)
    return seeds

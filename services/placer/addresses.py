"""The addresses a plan advertises: what makes one usable (C4), and the Direct path's
per-epoch mesh addresses (G7)."""

from __future__ import annotations

import functools
import ipaddress

MESH_NETWORK = ipaddress.IPv4Network("100.64.0.0/10")
_BROADCAST = ipaddress.IPv4Address("255.255.255.255")


@functools.lru_cache(maxsize=1 << 16)  # a fleet's addresses, judged on every plan: parse once
def _ip(address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address, with IPv4-mapped IPv6 (::ffff:a.b.c.d) judged as the IPv4 it carries."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


@functools.lru_cache(maxsize=1 << 16)  # judged again for every plan that advertises it
def address_problem(address: str) -> str | None:
    """C4: an advertised address must be a real unicast address."""
    ip = _ip(address)
    if ip is None:
        return f"{address!r} is not an IP address"
    if ip.is_unspecified:
        return f"{address} is unspecified"
    if ip.is_multicast:
        return f"{address} is multicast"
    if isinstance(ip, ipaddress.IPv4Address) and ip == _BROADCAST:
        return f"{address} is broadcast"
    return None


def is_loopback(address: str) -> bool:
    ip = _ip(address)
    return ip is not None and ip.is_loopback


def ip_family(address: str) -> int:
    ip = _ip(address)
    return ip.version if ip is not None else 0


def mesh_addresses(mesh_id: str, members: int) -> list[str]:
    """Direct path: per-epoch addresses in 100.64.0.0/10, one /24 chosen by the mesh id."""
    subnets = MESH_NETWORK.num_addresses // 256
    subnet = int(mesh_id[:8], 16) % subnets
    base = int(MESH_NETWORK.network_address) + subnet * 256
    return [str(ipaddress.IPv4Address(base + rank + 1)) for rank in range(members)]

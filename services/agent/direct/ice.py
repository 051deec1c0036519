"""One pair's ICE (G11), with aioice: gather this member's candidates (host, and the
server-reflexive one a relay's STUN reports), check them against the peer's, and say which
path won, so WireGuard can send on it (services/agent/wgport.py).

aioice binds one ephemeral UDP port per connection and offers no public accessor for the
nominated pair; its maintainer's advice for this very use (handing the pair to WireGuard,
aiortc/aioice#49) is to read `_nominated`. That one read is kept in `_nominated_pair`,
checked, and pinned by the dependency's version range.
"""

from __future__ import annotations

import asyncio
import ipaddress
from dataclasses import dataclass

import aioice
import aioice.ice
from aioice.candidate import Candidate

MESH = ipaddress.ip_network("100.64.0.0/10")  # nodus0's own addresses are no underlay
CHECK_TIMEOUT = 10.0


class IceFailed(Exception):
    """No candidate pair worked (UDP blocked, or NATs that do not let a hole be punched)."""


@dataclass(frozen=True)
class Offer:
    """What one side sends the other: its ICE credentials and candidates (SDP lines)."""

    ufrag: str
    pwd: str
    candidates: tuple[str, ...]


@dataclass(frozen=True)
class Path:
    """The pair that won: the local socket's address and the peer's, and what kind each is."""

    local: tuple[str, int]
    remote: tuple[str, int]
    local_kind: str  # host | srflx
    remote_kind: str


def _underlay(candidate: Candidate) -> bool:
    try:
        address = ipaddress.ip_address(candidate.host)
    except ValueError:
        return False
    return address.version == 4 and address not in MESH and not address.is_loopback


# The addresses ICE may gather on: the machine's own (the fleet's `address`, its eth0), set
# by the agent; None: every IPv4 address but nodus0's.
UNDERLAY: set[str] | None = None


def _underlay_addresses(use_ipv4: bool, use_ipv6: bool) -> list[str]:
    return [
        address
        for address in _all_host_addresses(use_ipv4, use_ipv6)
        if ipaddress.ip_address(address).version == 4
        and ipaddress.ip_address(address) not in MESH
        and (UNDERLAY is None or address in UNDERLAY)
    ]


# aioice gathers on every address of the machine and has no filter for it. A check sent from
# nodus0's address can win and leave WireGuard with a path through itself; one from a private
# network's interface can be nominated on one side only (its STUN also waits out a timeout
# there). Its gathering calls this module-level function: the agent narrows it to the
# machine's own address.
_all_host_addresses = aioice.ice.get_host_addresses
aioice.ice.get_host_addresses = _underlay_addresses


def _nominated_pair(
    connection: aioice.Connection,
) -> tuple[Candidate, tuple[str, int], Candidate | None]:
    nominated = getattr(connection, "_nominated", None)
    pair = nominated.get(1) if isinstance(nominated, dict) else None
    if pair is None or not hasattr(pair, "local_candidate") or not hasattr(pair, "remote_addr"):
        raise IceFailed(
            f"aioice {aioice.__version__} connected but its nominated pair cannot be read "
            "(its private layout changed: check the version range in pyproject.toml)"
        )
    return pair.local_candidate, tuple(pair.remote_addr), pair.remote_candidate


class PairIce:
    """ICE for one pair; the member with the smaller name is controlling (both agree)."""

    def __init__(self, controlling: bool, stun_server: tuple[str, int] | None) -> None:
        self.connection = aioice.Connection(
            ice_controlling=controlling, components=1, stun_server=stun_server, use_ipv6=False
        )

    async def offer(self) -> Offer:
        await self.connection.gather_candidates()
        candidates = tuple(c.to_sdp() for c in self.connection.local_candidates if _underlay(c))
        return Offer(self.connection.local_username, self.connection.local_password, candidates)

    async def connect(self, peer: Offer, timeout: float = CHECK_TIMEOUT) -> Path:
        connection = self.connection
        connection.remote_username = peer.ufrag
        connection.remote_password = peer.pwd
        for line in peer.candidates:
            try:
                candidate = Candidate.from_sdp(line)
            except (ValueError, IndexError):
                continue  # a peer's malformed candidate costs only that candidate
            if _underlay(candidate):
                await connection.add_remote_candidate(candidate)
        await connection.add_remote_candidate(None)
        try:
            await asyncio.wait_for(connection.connect(), timeout)
        except (ConnectionError, TimeoutError) as error:
            raise IceFailed(f"no candidate pair answered: {error or 'timed out'}") from None
        local, remote, remote_candidate = _nominated_pair(connection)
        return Path(
            local=(local.host, local.port),
            remote=(remote[0], int(remote[1])),
            local_kind=local.type,
            remote_kind=remote_candidate.type if remote_candidate is not None else "prflx",
        )

    async def close(self) -> None:
        """Free the checks' socket: WireGuard takes its port over (wgport.py). Only once the
        peer has its path too: until then this socket answers the peer's checks (the side
        that nominates finishes first)."""
        await self.connection.close()

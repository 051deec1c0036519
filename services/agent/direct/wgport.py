"""WireGuard sends to each peer from the port that pair's ICE checks opened (G11).

wireguard-go has one listen port, while aioice checks every pair from a socket of its own;
the NAT in front of this machine mapped that socket's port for that peer. So, per peer, an
nftables rule in this machine's namespace rewrites the source of WireGuard's datagrams to
that peer (from the listen port, to the peer's address) to the checks' address and port;
conntrack maps the peer's answers back to the listen port. The rule goes in before
WireGuard's endpoint is set, so its first datagram already leaves from the checks' port,
and the NAT mapping the checks made carries on (kept open by WireGuard's keepalives).
A datagram the peer sends first (its side switched a moment earlier, or it sends before
this side has anything to send) is taken in the same way: a second rule hands what comes
from the peer's address to the checks' port over to the listen port, and the flow it opens
is the one the rewrite would have made, so either side may open the path.

The whole table is written in one nftables transaction each time, so the rules are never
half-applied.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from services.agent import nft

TABLE = "nodus_wgport"
WHAT = "WireGuard's port rules"


@dataclass(frozen=True)
class Mapping:
    local: tuple[str, int]  # the checks' socket
    remote: tuple[str, int]  # the peer's address the checks reached


def render(table: str, listen_port: int, mappings: dict[str, Mapping]) -> str:
    rewrites = "".join(
        f"    ip daddr {m.remote[0]} udp sport {listen_port} udp dport {m.remote[1]} "
        f'snat ip to {m.local[0]}:{m.local[1]} comment "{peer}"\n'
        for peer, m in sorted(mappings.items())
    )
    # The peer's datagram that arrives before ours left: to WireGuard as well. Dropping it
    # instead (a flow of its own on the checks' port would make the rewrite pick another
    # port) would leave the pair carrying nothing until this side happened to send.
    early = "".join(
        f"    ip saddr {m.remote[0]} udp sport {m.remote[1]} udp dport {m.local[1]} "
        f'dnat ip to {m.local[0]}:{listen_port} comment "{peer}"\n'
        for peer, m in sorted(mappings.items())
    )
    return (
        f"table ip {table} {{}}\n"
        f"delete table ip {table}\n"  # its chains too: an older agent's may be of another type
        f"table ip {table} {{\n"
        "  chain prerouting {\n"
        "    type nat hook prerouting priority dstnat; policy accept;\n"
        f"{early}"
        "  }\n"
        "  chain postrouting {\n"
        "    type nat hook postrouting priority srcnat; policy accept;\n"
        f"{rewrites}"
        "  }\n"
        "}\n"
    )


async def forget_flows(local_port: int) -> None:
    """Delete this namespace's conntrack entries of UDP flows from or to `local_port`: the
    checks' flows, whichever side began them."""
    for direction in ("--orig-port-src", "--orig-port-dst"):
        process = await asyncio.create_subprocess_exec(
            "conntrack",
            "-D",
            "-p",
            "udp",
            direction,
            str(local_port),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        await process.wait()  # exit 1 when there was none: nothing to forget


class PortMap:
    """This machine's per-peer source ports for WireGuard; one per `nodus0`."""

    def __init__(self, listen_port: int, table: str = TABLE) -> None:
        self.listen_port = listen_port
        self.table = table
        self.mappings: dict[str, Mapping] = {}

    async def set(self, peer: str, mapping: Mapping) -> None:
        """Map `peer`; call it after the checks' socket closed and before WireGuard's
        endpoint for the peer is set."""
        self.mappings[peer] = mapping
        await nft.apply(render(self.table, self.listen_port, self.mappings), WHAT)
        # The checks' own flow still holds the port in this machine's conntrack; while it
        # does, the rewrite would pick another port, one the NAT never mapped.
        await forget_flows(mapping.local[1])

    async def remove(self, peer: str) -> None:
        if self.mappings.pop(peer, None) is not None:
            await nft.apply(render(self.table, self.listen_port, self.mappings), WHAT)

    async def close(self) -> None:
        self.mappings.clear()
        await nft.apply(f"table ip {self.table} {{}}\ndelete table ip {self.table}\n", WHAT)

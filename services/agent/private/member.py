"""A member's port rules on its provider's private network (G22): while its gang epoch runs,
the rendezvous port and the ports NCCL and Gloo listen on (the machine's ephemeral range)
take new connections on the private interface from the gang's members only; anyone else on
that network is refused (a TCP reset, at once). The rules go when the epoch ends.

One nftables table per gang epoch, written in one transaction (never half applied), so an
epoch that starts while the previous one's rules are still being removed does not disturb
them.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path

from libs.contracts.errors import NodusError
from services.agent import nft

log = logging.getLogger("nodus.agent.private")

EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")


@dataclass(frozen=True)
class PortRules:
    gang: str
    epoch: int
    interface: str  # the private network's interface on this machine
    members: tuple[str, ...]  # the other members' private addresses
    rendezvous_port: int
    ephemeral: tuple[int, int]

    @property
    def table(self) -> str:
        digest = hashlib.sha256(f"{self.gang}.{self.epoch}".encode()).hexdigest()[:12]
        return f"nodus_gang_{digest}"

    def render(self) -> str:
        low, high = self.ephemeral
        ports = f"{{ {self.rendezvous_port}, {low}-{high} }}"
        members = ", ".join(self.members) if self.members else "127.0.0.1"
        comment = f"{self.gang} epoch {self.epoch}"
        return (
            f"table inet {self.table} {{}}\n"
            f"delete table inet {self.table}\n"
            f"table inet {self.table} {{\n"
            f'  comment "{comment}: rendezvous and NCCL ports for the members only"\n'
            "  chain input {\n"
            "    type filter hook input priority filter - 1; policy accept;\n"
            f'    iifname "{self.interface}" tcp dport {ports} ct state new '
            f"ip saddr {{ {members} }} accept\n"
            f'    iifname "{self.interface}" tcp dport {ports} ct state new '
            "reject with tcp reset\n"
            "  }\n"
            "}\n"
        )

    def render_delete(self) -> str:
        return f"table inet {self.table} {{}}\ndelete table inet {self.table}\n"


def ephemeral_range() -> tuple[int, int]:
    try:
        low, high = EPHEMERAL.read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


class PrivateMember:
    """The Private path's dataplane is the provider's network; the agent's part is the rules."""

    def __init__(self, rules: PortRules) -> None:
        self.rules = rules

    async def start(self) -> None:
        await nft.apply(self.rules.render(), "the private network's port rules")
        log.info(
            "%s epoch %d: ports %d and %d-%d on %s open to %s only",
            self.rules.gang,
            self.rules.epoch,
            self.rules.rendezvous_port,
            *self.rules.ephemeral,
            self.rules.interface,
            ", ".join(self.rules.members) or "nobody",
        )

    async def adopt(self) -> None:
        """An agent started again on the same boot: the rules are kernel state and still hold;
        they are written only if missing (never deleted and made again under live traffic)."""
        if await nft.table_exists("inet", self.rules.table):
            log.info("%s epoch %d: port rules adopted", self.rules.gang, self.rules.epoch)
            return
        await self.start()

    async def stop(self) -> None:
        try:
            await nft.apply(self.rules.render_delete(), "removing the private network's port rules")
        except NodusError as error:  # the namespace went first, say
            log.warning("%s", error)

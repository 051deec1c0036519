"""The lab's shape, computed from a fleet: which network namespaces, links, addresses, routes
and NAT rules make one host look like machines of several providers. Pure: no I/O here, so
the plan is checked (and tested) before anything is created.

The picture:

    nodus-<machine> eth0 ── lan ─ nodus-r<n> (a provider region's router) ─ wan ┐
                                   masquerades out of wan when its LAN is `nat` │
    nodus-control (bus, relays, services) ─────────────────────────────── core ─┤ nodus-inet
    the host ── nodus-host veth ── nodus-control                                │ (a bridge
                                                                                ┘  and routes)
    nodus-<machine> <privateInterface> ── nodus-p<n> (a private network's switch)

Every address is in 198.18.0.0/15 (RFC 2544, for benchmark labs) and nothing routes outside
it: the namespaces have no default route beyond the lab's own "internet".
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass, field

from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.fleet import Fleet, Machine

LAB_RANGE = ipaddress.IPv4Network("198.18.0.0/15")
CORE = ipaddress.IPv4Network("198.18.0.0/24")  # the "internet" exchange: inet, control, routers
HOST_LINK = ipaddress.IPv4Network("198.18.255.252/30")  # the host <-> control namespace
INET_ADDRESS = ipaddress.IPv4Address("198.18.0.254")
CONTROL_ADDRESS = ipaddress.IPv4Address("198.18.0.1")  # where the bus and relays listen
HOST_ADDRESS = ipaddress.IPv4Address("198.18.255.253")
CONTROL_HOST_SIDE = ipaddress.IPv4Address("198.18.255.254")
ROUTER_HOST = 254  # a LAN's router takes .254 of its /24


@dataclass(frozen=True)
class Lan:
    """The machines of one provider region that share a router (a NAT one, or not)."""

    router: str  # its namespace
    provider: str
    region: str
    nat: bool
    subnet: ipaddress.IPv4Network
    uplink: ipaddress.IPv4Address  # the router's address on the core (its public address)
    machines: tuple[str, ...]

    @property
    def gateway(self) -> ipaddress.IPv4Address:
        return self.subnet.network_address + ROUTER_HOST


@dataclass(frozen=True)
class PrivateNetwork:
    switch: str  # the namespace holding its bridge
    name: str
    subnet: ipaddress.IPv4Network
    members: tuple[tuple[str, str, str], ...]  # (machine, interface, address)


@dataclass(frozen=True)
class Topology:
    prefix: str
    machines: dict[str, str]  # machine name -> its namespace
    addresses: dict[str, ipaddress.IPv4Address]  # machine name -> eth0
    lans: tuple[Lan, ...]
    private_networks: tuple[PrivateNetwork, ...]
    # The host's end of the link to the control namespace (the CLI reaches the bus through
    # it); None for a lab the host need not reach. One lab at a time can have it.
    host_link: str | None
    inet: str = field(default="")
    control: str = field(default="")

    @property
    def namespaces(self) -> list[str]:
        """Every namespace the lab makes, in the order they are made."""
        return [
            self.inet,
            self.control,
            *(lan.router for lan in self.lans),
            *(net.switch for net in self.private_networks),
            *self.machines.values(),
        ]


def _invalid(message: str) -> NodusError:
    return NodusError(ErrorCode.INVALID, f"network lab: {message}")


def _lab_address(machine: Machine, field_name: str, value: str) -> ipaddress.IPv4Address:
    try:
        address = ipaddress.ip_address(value)
    except ValueError:
        raise _invalid(
            f"machine {machine.name}: {field_name} {value!r} is not an address"
        ) from None
    if not isinstance(address, ipaddress.IPv4Address) or address not in LAB_RANGE:
        raise _invalid(
            f"machine {machine.name}: {field_name} {value} is outside {LAB_RANGE}, "
            "the range the lab may use"
        )
    if address in CORE or address in HOST_LINK:
        raise _invalid(
            f"machine {machine.name}: {field_name} {value} is in {CORE} or {HOST_LINK}, "
            "which the lab keeps for its routers and control plane"
        )
    host = int(address) & 0xFF
    if host in (0, 255, ROUTER_HOST):
        raise _invalid(
            f"machine {machine.name}: {field_name} {value} ends in .{host}, kept for the "
            "network, broadcast or router"
        )
    return address


def _one_subnet(
    kind: str, names: Iterable[str], addresses: list[ipaddress.IPv4Address]
) -> ipaddress.IPv4Network:
    subnets = {ipaddress.IPv4Network(f"{a}/24", strict=False) for a in addresses}
    if len(subnets) != 1:
        raise _invalid(
            f"{kind} ({', '.join(names)}) spans {', '.join(sorted(map(str, subnets)))}: "
            "its machines share one /24"
        )
    return subnets.pop()


def _lans(
    fleet: Fleet, prefix: str, addresses: dict[str, ipaddress.IPv4Address]
) -> tuple[Lan, ...]:
    grouped: dict[tuple[str, str, bool], list[Machine]] = {}
    for machine in fleet.machines:
        grouped.setdefault((machine.provider, machine.region, machine.nat), []).append(machine)
    lans = []
    for n, ((provider, region, nat), machines) in enumerate(sorted(grouped.items())):
        names = [m.name for m in machines]
        kind = f"{provider} {region}{' behind NAT' if nat else ''}"
        subnet = _one_subnet(kind, names, [addresses[m] for m in names])
        lans.append(
            Lan(
                router=f"{prefix}r{n}",
                provider=provider,
                region=region,
                nat=nat,
                subnet=subnet,
                uplink=CORE.network_address + 2 + n,
                machines=tuple(names),
            )
        )
    taken: dict[ipaddress.IPv4Network, Lan] = {}
    for lan in lans:
        other = taken.setdefault(lan.subnet, lan)
        if other is not lan:
            raise _invalid(
                f"{lan.provider} {lan.region} and {other.provider} {other.region} both use "
                f"{lan.subnet}: each LAN has a /24 of its own"
            )
    return tuple(lans)


def _private_networks(fleet: Fleet, prefix: str) -> tuple[PrivateNetwork, ...]:
    grouped: dict[str, list[Machine]] = {}
    for machine in fleet.machines:
        if machine.private_network:
            grouped.setdefault(machine.private_network, []).append(machine)
    networks = []
    for n, (name, machines) in enumerate(sorted(grouped.items())):
        addresses = [_lab_address(m, "privateAddress", m.private_address or "") for m in machines]
        subnet = _one_subnet(f"private network {name}", [m.name for m in machines], addresses)
        networks.append(
            PrivateNetwork(
                switch=f"{prefix}p{n}",
                name=name,
                subnet=subnet,
                members=tuple(
                    (m.name, m.private_interface, str(a))
                    for m, a in zip(machines, addresses, strict=True)
                ),
            )
        )
    return tuple(networks)


def plan(fleet: Fleet, prefix: str = "nodus-", reach_from_host: bool = True) -> Topology:
    """The lab for `fleet`; a fleet the lab cannot build is refused with what to change."""
    if len(prefix) > 12:
        raise _invalid(f"prefix {prefix!r} is longer than 12 characters")
    addresses = {m.name: _lab_address(m, "address", m.address) for m in fleet.machines}
    if len(set(addresses.values())) != len(addresses):
        raise _invalid("two machines share an address")
    lans = _lans(fleet, prefix, addresses)
    privates = _private_networks(fleet, prefix)
    lan_subnets = {lan.subnet for lan in lans}
    for net in privates:
        if net.subnet in lan_subnets:
            raise _invalid(f"private network {net.name} reuses the LAN subnet {net.subnet}")
    return Topology(
        prefix=prefix,
        machines={m.name: f"{prefix}{m.name}" for m in fleet.machines},
        addresses=addresses,
        lans=lans,
        private_networks=privates,
        host_link=f"{prefix}host"[:15] if reach_from_host else None,
        inet=f"{prefix}inet",
        control=f"{prefix}control",
    )


# -- the commands that build it ---------------------------------------------------------------


def _ip(namespace: str, *args: str) -> list[str]:
    return ["ip", "-n", namespace, *args]


def _veth(a_ns: str, a_name: str, b_ns: str, b_name: str) -> list[list[str]]:
    return [
        [
            "ip",
            "link",
            "add",
            "name",
            a_name,
            "netns",
            a_ns,
            "type",
            "veth",
            "peer",
            "name",
            b_name,
            "netns",
            b_ns,
        ],
        _ip(a_ns, "link", "set", a_name, "up"),
        _ip(b_ns, "link", "set", b_name, "up"),
    ]


def _bridge(namespace: str, name: str, address: str | None = None) -> list[list[str]]:
    commands = [
        _ip(namespace, "link", "add", "name", name, "type", "bridge"),
        _ip(namespace, "link", "set", name, "up"),
    ]
    if address is not None:
        commands.append(_ip(namespace, "addr", "add", address, "dev", name))
    return commands


def forwarding(namespace: str) -> list[str]:
    return ["ip", "netns", "exec", namespace, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"]


def nat_rules(lan: Lan) -> str:
    """The router's NAT, the kind most clouds and homes have: what leaves for the internet
    from the LAN takes the router's public address (the source port kept when it can), and
    what arrives is let in only as the answer to a flow that went out (port-restricted cone).
    Dropping the rest before conntrack confirms it keeps an early datagram of a peer that is
    punching a hole from taking the mapping the outgoing flow needs."""
    return (
        "table ip nodus_nat {\n"
        "  chain prerouting {\n"
        "    type filter hook prerouting priority filter; policy accept;\n"
        '    iifname "wan" ct state new drop\n'
        "  }\n"
        "  chain postrouting {\n"
        "    type nat hook postrouting priority srcnat; policy accept;\n"
        f'    ip saddr {lan.subnet} oifname "wan" masquerade\n'
        "  }\n"
        "}\n"
    )


def _host_link(name: str, control: str) -> list[list[str]]:
    """The host's way to the control namespace; the route to the core refuses a second lab's."""
    return [
        [
            "ip",
            "link",
            "add",
            "name",
            name,
            "type",
            "veth",
            "peer",
            "name",
            "host",
            "netns",
            control,
        ],
        ["ip", "addr", "add", f"{HOST_ADDRESS}/{HOST_LINK.prefixlen}", "dev", name],
        ["ip", "link", "set", name, "up"],
        _ip(control, "addr", "add", f"{CONTROL_HOST_SIDE}/{HOST_LINK.prefixlen}", "dev", "host"),
        _ip(control, "link", "set", "host", "up"),
        ["ip", "route", "add", str(CORE), "via", str(CONTROL_HOST_SIDE), "dev", name],
    ]


def build_commands(topology: Topology) -> list[list[str]]:
    """`ip` commands that build the links, addresses and routes (namespaces exist already;
    NAT rules are loaded separately, with `nft -f -`)."""
    t = topology
    core = CORE.prefixlen
    commands: list[list[str]] = []
    for namespace in t.namespaces:
        commands.append(_ip(namespace, "link", "set", "lo", "up"))
    commands += _bridge(t.inet, "core", f"{INET_ADDRESS}/{core}")
    commands.append(forwarding(t.inet))
    # The control plane: on the core, and reachable from the host.
    commands += _veth(t.control, "core", t.inet, "control")
    commands.append(_ip(t.inet, "link", "set", "control", "master", "core"))
    commands.append(_ip(t.control, "addr", "add", f"{CONTROL_ADDRESS}/{core}", "dev", "core"))
    commands.append(_ip(t.control, "route", "add", str(LAB_RANGE), "via", str(INET_ADDRESS)))
    if t.host_link is not None:
        commands += _host_link(t.host_link, t.control)
    for lan in t.lans:
        commands += _veth(lan.router, "wan", t.inet, f"r{t.lans.index(lan)}")
        commands.append(_ip(t.inet, "link", "set", f"r{t.lans.index(lan)}", "master", "core"))
        commands.append(_ip(lan.router, "addr", "add", f"{lan.uplink}/{core}", "dev", "wan"))
        commands.append(_ip(lan.router, "route", "add", str(LAB_RANGE), "via", str(INET_ADDRESS)))
        commands += _bridge(lan.router, "lan", f"{lan.gateway}/{lan.subnet.prefixlen}")
        commands.append(forwarding(lan.router))
        if not lan.nat:  # its machines' addresses are public: the internet routes to them
            commands.append(_ip(t.inet, "route", "add", str(lan.subnet), "via", str(lan.uplink)))
        for n, machine in enumerate(lan.machines):
            namespace = t.machines[machine]
            commands += _veth(namespace, "eth0", lan.router, f"m{n}")
            commands.append(_ip(lan.router, "link", "set", f"m{n}", "master", "lan"))
            prefix = lan.subnet.prefixlen
            commands.append(
                _ip(namespace, "addr", "add", f"{t.addresses[machine]}/{prefix}", "dev", "eth0")
            )
            commands.append(_ip(namespace, "route", "add", "default", "via", str(lan.gateway)))
    for net in t.private_networks:
        commands += _bridge(net.switch, "switch")
        for n, (machine, interface, address) in enumerate(net.members):
            namespace = t.machines[machine]
            commands += _veth(namespace, interface, net.switch, f"m{n}")
            commands.append(_ip(net.switch, "link", "set", f"m{n}", "master", "switch"))
            commands.append(
                _ip(namespace, "addr", "add", f"{address}/{net.subnet.prefixlen}", "dev", interface)
            )
    return commands

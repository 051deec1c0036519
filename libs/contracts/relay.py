"""Records of the Relayed dataplane: members' WireGuard keys, relays, and usage for billing."""

from __future__ import annotations

import base64
from datetime import datetime

from libs.contracts.base import Name, Record

# A Relayed member uses two relays (G15): one home, chosen by the placer
# (`EpochMember.relay_slot`), and the other for failover.
RELAYS_PER_MEMBER = 2

# A relay whose heartbeat is older than this is not used for a new tunnel.
RELAY_FRESH_SECONDS = 10.0

# An agent or relay that reads `Epoch.relays` (the gang's two relays, chosen by the placer
# among every live relay) says so among its capabilities. A gang gets them only when its
# members' agents and every live relay do (records refuse unknown fields); otherwise its
# members use the first two live relays by name, as before.
CAPABILITY_EPOCH_RELAYS = "epoch-relays"


class Member(Record):
    """Written once per (gang, epoch, node) when the node redeems its join key: binds the
    node's WireGuard public key to the epoch. Relays admit only keys recorded here (S2)."""

    gang: str
    epoch: int
    node: Name
    rank: int
    address: str  # advertised (G7)
    wg_public_key: str  # base64, WireGuard's format
    joined_time: datetime


class IceOffer(Record):
    """What a Direct member tells one peer for ICE (G11): its credentials and candidates (SDP
    candidate lines), then, once its checks found a path, `connected`, so the peer knows the
    checks' socket may close."""

    gang: str
    epoch: int
    node: Name
    peer: Name
    ufrag: str
    pwd: str
    candidates: list[str]
    connected: bool = False
    failed: str = ""  # why this side's checks found no path, when they did not
    # Checks run again when a pair lost its direct path (G13); the higher round wins, and
    # each side joins the other's.
    round: int = 0


class PathHeartbeat(Record):
    """What a Direct member's agent says to each peer's agent over `nodus0` (UDP, a few
    times a second): the ICE round it is on and whether it sends to the peer directly. The
    sender is the mesh address it came from (WireGuard authenticated it)."""

    round: int
    direct: bool


class MemberPaths(Record):
    """A Direct member's path to each peer, written when one changes: `direct`, or
    `derp:<region>` while the pair falls back to the relays (G13). The gang's run turns it
    into `NetworkDegraded`."""

    gang: str
    epoch: int
    node: Name
    paths: dict[str, str]  # peer node -> direct | derp:<region> | none
    changed_time: datetime


# A relay that takes a member's own total of what it sent (`Sent`, libs/jobs/billing.py). A
# member tells it only to relays that announce this, so relays are upgraded before members.
CAPABILITY_USAGE_TOTALS = "usage-totals-v1"

# A relay that hands a member on to the relay it names (`Route`) when both share a port of
# their host. A member names its relay only to relays that announce this, and dials a relay's
# `shared_address` (which only such relays write) before its own.
CAPABILITY_ROUTE = "route-v1"


class RelayRecord(Record):
    """A relay announces itself (C6): where members dial it and the key they prove theirs to."""

    name: Name
    region: Name
    address: str  # host:port members and mesh peers dial
    public_key: str  # base64 X25519: members prove possession of their WireGuard key with it
    version: str
    capabilities: list[str]
    heartbeat_time: datetime
    # host:port of the relay's STUN on UDP (G11: members learn their NAT's address); "" if off.
    stun_address: str = ""
    # host:port of a port the relay shares with the other relays of its host (443, so that a
    # member behind a firewall that opens only 443 reaches every one of them): a member dials
    # it before `address`, and names the relay it means when another answers. "" if none.
    shared_address: str = ""


RelayDoor = tuple[str, str, bytes | None]  # name, host:port, key (see member_door)


def member_door(record: RelayRecord) -> RelayDoor:
    """A relay's name, where a member dials it, and the key by which the member knows it
    answered (None: the relay cannot hand a member on, so it takes whichever answers)."""
    if CAPABILITY_ROUTE not in record.capabilities:
        return record.name, record.address, None
    address = record.shared_address or record.address
    return record.name, address, base64.b64decode(record.public_key)


class RelayLoad(Record):
    """One relay as `nodus get relays` shows it."""

    name: str
    region: str
    address: str
    version: str
    live: bool
    heartbeat_time: datetime
    members: int  # members of active Relayed gangs homed on it
    # What the placer balances: the sum of those members' shares of their gangs' caps (G18).
    cap_mbps: int
    gangs: list[str]  # active gangs that name it, as home or failover (Direct: fallback)
    # Where members dial it when it shares a port with the other relays of its host.
    shared_address: str = ""


class UsageRecord(Record):
    """Bytes one member's programs sent through one relay in one interval (the plaintext of
    its WireGuard transport messages: WireGuard's own header, tag, keepalives and handshakes
    are not billed), and the member's own total of them so far, counted once (`reported`: 0
    when it told none; libs/jobs/billing.py weighs the two); published with the id
    `relay:boot:gang:epoch:node:seq` so a retried flush lands once (G17)."""

    relay: str
    boot: str
    gang: str
    epoch: int
    node: Name
    seq: int
    bytes_sent: int
    start_time: datetime
    end_time: datetime
    reported: int = 0

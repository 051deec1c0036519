"""Epochs (one attempt of a gang with a fixed member set), join keys, plan bounds, ranktables."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

import msgspec

from libs.contracts.base import Name, Record
from libs.contracts.jobs import PathClass


class Bounds(Record):
    """Limits derived from one formula (`libs.contracts.bounds.derive`), shown in the plan (C3)."""

    relay_gang_bits_per_second: int
    relay_member_bits_per_second: int
    tunnel_buffer_bytes: int
    probe_readiness_seconds: float
    probe_sample_seconds: float
    join_key_ttl_seconds: float


class EpochMember(Record):
    rank: int
    node: Name
    address: str  # the advertised address (G7)
    interface: str  # what NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME name
    devices: list[str]  # backend-derived device names, CUDA0.. or ROCm0.. (C5)
    env: dict[str, str]  # the rank's whole environment (G8)
    # The machine's boot when placed: a member whose machine booted since (its agent
    # restarted) has lost its ranks and tunnels, and its epoch ends.
    boot_id: str = ""
    # Relayed: the member homes on the relay in this place of the gang's two (`Epoch.relays`;
    # when empty, the first two live relays by name); the other is its failover.
    relay_slot: int = 0


class Epoch(Record):
    """Persisted to KV before any command naming it leaves (C2, G9)."""

    gang: str  # org.name
    epoch: int
    path: PathClass
    mesh_id: str  # fresh per epoch: the epoch's network identity
    verify_key: str  # base64 Ed25519 public key that verifies this epoch's join keys
    members: list[EpochMember]
    bounds: Bounds
    created_time: datetime
    join_keys_expire_time: datetime
    placed_by: str
    fenced: bool = False
    # The gang's two relays by name, the nearest and least loaded when placed (G15), so adding
    # relays (one per core of a relay host, or more hosts) adds capacity: Relayed members home
    # on them, Direct pairs fall back to them (G13). Empty: the first two live relays by name
    # (see CAPABILITY_EPOCH_RELAYS); Private: none.
    relays: list[str] = []


# An agent that reads a join key naming every member (`JoinClaims.nonces`) says so among its
# capabilities; a gang with any member whose agent does not gets a one-member key each.
CAPABILITY_JOIN_KEY_MEMBERS = "join-key-members"


class JoinClaims(Record):
    """What a join key says; signed by the epoch's mesh identity, valid for 15 minutes, once
    per member: `nonces` names each member with the nonce it redeems. `node` and `nonce` are
    the one-member form, minted for a gang with an agent that reads no other (see
    CAPABILITY_JOIN_KEY_MEMBERS)."""

    gang: str
    epoch: int
    mesh_id: str
    expires_time: datetime
    nonces: dict[Name, str] = {}
    node: Name | None = None
    nonce: str = ""

    def nonce_of(self, node: str) -> str | None:
        """The nonce `node` redeems, or None when the key does not name it."""
        if self.node is not None:
            return self.nonce if self.node == node else None
        return self.nonces.get(node)


class JoinKeyGrant(Record):
    """KV record under `<node>.<org>.<name>.<epoch>`: only that node may read it (S1). It
    brings the epoch as persisted, since the node may read no other gang's records."""

    token: str
    verify_key: str
    epoch: Epoch | None = None


class JoinKeyGrantWire(Record):
    """A JoinKeyGrant as written, its epoch given already encoded: the placer writes that
    epoch as its own record too, and encodes it once. Read it back as a JoinKeyGrant."""

    token: str
    verify_key: str
    epoch: msgspec.Raw


class Lease(Record):
    """A machine held by one gang epoch; created compare-and-set, so a machine has one owner."""

    gang: str
    epoch: int
    placer: str
    created_time: datetime | None = None


class AddressClaim(Record):
    """An address routed by one running Relayed gang (G7)."""

    gang: str
    epoch: int
    node: Name
    # When claimed: a claim no live epoch explains is freed once older than a commit takes.
    created_time: datetime | None = None


class RanktableEntry(Record):
    rank: int
    node: Name
    address: str
    eth0: str
    devices: list[str]
    status: str


class Ranktable(Record):
    """Per-gang ranktable; the bucket as a whole, watched in order, is the global ranktable (T2)."""

    gang: str
    epoch: int
    path: PathClass
    phase: str
    entries: list[RanktableEntry]
    updated_time: datetime


class EpochStamp(Record):
    """Minimal header of any epoch-scoped message, checked by the epoch guard (C2)."""

    gang: str
    epoch: int
    kind: Literal["epoch"] = "epoch"


class JoinRedemption(Record):
    """Written compare-and-set when a join key is used; a second use finds it and is refused."""

    gang: str
    epoch: int
    node: Name
    redeemed_time: datetime

"""The placer's config file (`nodus placer --config`): beta access, the Relayed member limit,
the qualification table, required capabilities, timings."""

from __future__ import annotations

from typing import Annotated

import msgspec

from libs.contracts.base import Record
from libs.contracts.bounds import HEARTBEAT_TIMEOUT_SECONDS
from libs.contracts.jobs import MAX_MEMBERS, MIN_MEMBERS, PairPattern


class Qualified(Record):
    """Offering combinations qualified per path by the operator (G21), beside the measured ones
    (`nodus qualify`, `nodus get qualifications`): every pair in a gang must match one."""

    private: list[PairPattern] = []
    direct: list[PairPattern] = []
    relayed: list[PairPattern] = []


class RequiredCapabilities(Record):
    """What a member's agent must announce for a path (C6)."""

    all: list[str] = []
    private: list[str] = []
    direct: list[str] = []
    relayed: list[str] = []


class PlacerConfig(Record):
    # Orgs with access to the distributed beta (G1); "*" opens it to every org.
    distributed_access: list[str] = []
    # Relayed gangs of up to this many members are placed on the qualified pairs (G2); a larger
    # one needs its pairs measured in a gang at least its size (`nodus qualify --members N`).
    relayed_max_members: Annotated[int, msgspec.Meta(ge=MIN_MEMBERS, le=MAX_MEMBERS)] = 2
    qualified: Qualified = msgspec.field(default_factory=Qualified)
    required_capabilities: RequiredCapabilities = msgspec.field(
        default_factory=RequiredCapabilities
    )
    master_port: Annotated[int, msgspec.Meta(ge=1024, le=65535)] = 29500
    shim_path: str = "/opt/nodus/lib/libnodus-netshim.so"
    # A directory every machine mounts (a shared filesystem): each job gets
    # `<root>/<org>/<name>/<admitted, unix s>` as NODUS_CHECKPOINT_DIR, the same in every
    # epoch. None: not set.
    checkpoint_root: str | None = None
    heartbeat_timeout_seconds: Annotated[float, msgspec.Meta(gt=0)] = HEARTBEAT_TIMEOUT_SECONDS
    # Attempts (epochs and collision retries) before a gang is left Pending with the reasons.
    max_attempts: Annotated[int, msgspec.Meta(ge=1, le=100)] = 8
    # Batches of jobs placed at once by one replica (their KV round trips overlap), and the
    # most jobs in one batch (planned in turn, committed together: a round trip per step).
    placement_concurrency: Annotated[int, msgspec.Meta(ge=1, le=256)] = 4
    placement_batch: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 64
    # Another replica takes over a Pending job its accepting placer left for this long.
    takeover_seconds: Annotated[float, msgspec.Meta(ge=0)] = 5.0

    def has_access(self, org: str) -> bool:
        return "*" in self.distributed_access or org in self.distributed_access

"""What an agent keeps of each epoch it joined, and how it speaks to an epoch's dataplane
process (O4): the machine is the truth, not the agent process. An agent that starts again on
the same boot reads these records back, re-adopts the dataplanes still running and starts
again, from the persisted key, those that died.

Records live under the agent's state directory (`epochs/<joinkey key>/`); the control channel
is a unix socket there, one length-prefixed msgspec JSON request and reply per exchange."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

import msgspec

from libs.contracts.base import Record
from libs.contracts.epochs import Epoch
from libs.contracts.lifecycle import JoinedEpoch


class DataplaneSpec(Record):
    """What an epoch's dataplane process runs: the Relayed tunnel and its SOCKS5 entry, or
    the Direct `nodus0` with ICE and its relay fallback."""

    kind: Literal["relayed", "direct"]
    node: str
    socks_listen: str = ""  # relayed: host:port of the SOCKS5 entry the shim dials
    underlay: str | None = None  # direct: the machine's own address, where ICE gathers
    # The machine's region and class: without the gang's relays, the nearest live ones.
    region: str = ""
    region_class: str = ""


class EpochState(Record):
    """One joined epoch as the agent persisted it (`state.json`; the WireGuard private key is
    beside it in `wg.key`, mode 0600). Written before the dataplane starts, so a crash between
    the two leaves a record the next agent adopts."""

    key: str  # the join key's key in nodus-joinkeys: its deletion ends the epoch here
    epoch: Epoch  # as the join key brought it
    joined: JoinedEpoch
    joined_time: datetime
    dataplane: DataplaneSpec | None = None  # None: Private (kernel rules) or nothing to run


class DataplaneProcess(Record):
    """The process running an epoch's dataplane (`process.json`): its pid, its start time
    (/proc/<pid>/stat field 22, so a pid reused since is not taken for it) and the machine's
    boot it was started in (another boot's is killed, never adopted)."""

    pid: int
    start_ticks: int
    boot_id: str
    started_time: datetime


# -- the control channel ---------------------------------------------------------------------


class StatusRequest(msgspec.Struct, tag="status"):
    """Is the dataplane ready, and (Relayed) which relay carries it."""


class PathRequest(msgspec.Struct, tag="path"):
    """The path the workload's bytes take to `peer` now; on Direct, once the pair's first
    round of checks ended (at most `wait` seconds)."""

    peer: str
    wait: float = 0.0


class MetricsRequest(msgspec.Struct, tag="metrics"):
    """The dataplane's metrics in the Prometheus text format, for the agent's /metrics."""


class StopRequest(msgspec.Struct, tag="stop"):
    """End the dataplane: the epoch is over for this member."""


ControlRequest = StatusRequest | PathRequest | MetricsRequest | StopRequest


class ControlReply(msgspec.Struct, omit_defaults=True):
    ok: bool = True
    error: str = ""
    ready: bool = False
    failed: str = ""  # the dataplane could not start: why
    path: str | None = None  # derp:<region> or direct
    relay: str | None = None  # Relayed: the home relay's name
    metrics: str = ""

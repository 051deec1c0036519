"""A gang's life after placement: probes per pair (G10, G11), ranks and their exits."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

import msgspec

from libs.contracts.base import Name, Record


class PairResult(Record):
    """One measured pair: the slowest of these is the gang's probe (G11)."""

    a: Name
    b: Name
    ok: bool
    rtt_ms: float = 0.0
    tcp_gbps: float = 0.0
    path: str = ""  # direct | derp:<region>
    connections: int = 0  # fresh TCP connections that succeeded during readiness
    error: str | None = None
    suspect: Name | None = None  # the member a failure points at; a re-placement avoids it
    measured_time: datetime | None = None


class ProbeRecord(Record):
    """KV `nodus-probes`, key `org.name.epoch`: the epoch's probe and its holder. The replica
    that creates it holds it and renews `heartbeatTime` while the job is Placed or Probing; a
    replica that finds the holder silent for longer than the takeover window, or restarted (same
    `prober`, another `instance`), takes it over with compare-and-set (one winner), counts an
    `attempt` and probes the epoch again from the start."""

    gang: str
    epoch: int
    state: Literal["Running", "Qualified", "Failed"]
    prober: str  # the runner replica holding it (the name kept: stored records carry it)
    started_time: datetime  # of this attempt
    rounds: int
    pairs: list[PairResult] = []
    finished_time: datetime | None = None
    reason: str | None = None
    instance: str = ""  # the holder's process: a replica restarted under its name is another
    heartbeat_time: datetime | None = None
    attempt: int = 1  # 1 + the takeovers of this epoch's probe
    # Its holder stopped (an upgrade, a drain) before it ended: another replica takes it over
    # at once instead of waiting for the heartbeat to age.
    released: bool = False


class RankStatus(Record):
    """KV `nodus-ranks`, key `org.name.epoch.rank.node` (names.rank_key): written by the agent
    that runs the rank, whose node ends the key so the bus lets it write only its own."""

    gang: str
    epoch: int
    rank: int
    node: Name
    state: Literal["Running", "Exited", "Stopped"]
    started_time: datetime
    exit_code: int | None = None
    ended_time: datetime | None = None
    log: str = ""  # where the agent keeps the rank's output


class ProbeServeRequest(Record):
    gang: str
    epoch: int


class ProbeServeReply(Record):
    address: str
    port: int


class ProbePairRequest(Record):
    """Asks member `a` to probe its peer at address:port through the workload's path."""

    gang: str
    epoch: int
    peer: Name
    address: str
    port: int
    connections: int = 3
    sample_seconds: float = 10.0
    readiness_seconds: float = 60.0
    measure: bool = True


class LaunchRequest(Record):
    """The runner's word to start a rank, with the job's command: an agent reads no job
    records (S1)."""

    gang: str
    epoch: int
    rank: int
    command: list[str]


class LaunchReply(Record):
    started: bool


class LogsRequest(Record):
    gang: str
    epoch: int
    rank: int
    offset: int = 0
    limit: int = 1 << 20


class LogsReply(Record):
    data: str
    offset: int  # where the next read continues
    state: str


class StopRequest(Record):
    gang: str
    epoch: int


class JoinedEpochsRequest(Record):
    """To `nodus.node.<node>.req.epochs`: which gang epochs has this node's agent joined."""


class JoinedEpoch(Record):
    gang: str
    epoch: int
    rank: int
    address: str
    path: str | None = None  # on Relayed: derp:<region> of the relay in use
    relay: str | None = None


class JoinedEpochsReply(Record):
    node: str
    epochs: list[JoinedEpoch]


class ShimCheckRequest(Record):
    """To `nodus.node.<node>.req.shim-check` (G10.3): load the shim into the job's launcher,
    the command's first word."""

    gang: str
    epoch: int
    launcher: list[str]


class ShimCheckReply(Record):
    node: str
    ok: bool
    error: str | None = None  # ShimNotLoaded: why, and what to do; CheckFailed: it did not run


class RankProcess(msgspec.Struct):
    """A running rank as the machine's disk remembers it (`<rank key>.pid` beside its log), so
    that an agent starting again finds it: the rank's keeper (its parent, the leader of its
    process group), and the boot it was started in."""

    status: RankStatus
    pid: int
    start_ticks: int  # /proc/<pid>/stat's start time: a pid reused since is not the keeper
    boot_id: str = ""  # empty: a record of an agent before keepers, never adopted

"""The Job: what a user applies (spec) and what Nodus reports (status)."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Literal

import msgspec

from libs.contracts.base import Name, Record

Backend = Literal["cuda", "rocm"]
Network = Literal["Colocated", "Regional", "Global"]
Transport = Literal["Direct", "Auto"]
Libc = Literal["glibc", "musl", "static"]

MIN_MEMBERS = 2
MAX_MEMBERS = 8


class PathClass(StrEnum):
    """One path class per gang (G6), ordered best first."""

    PRIVATE = "private"
    DIRECT = "direct"
    RELAYED = "relayed"


class Phase(StrEnum):
    PENDING = "Pending"
    PLACED = "Placed"
    PROBING = "Probing"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


FINISHED_PHASES = frozenset({Phase.SUCCEEDED, Phase.FAILED})


class ConditionType(StrEnum):
    ADMITTED = "Admitted"
    GANG_READY = "GangReady"
    NETWORK_QUALIFIED = "NetworkQualified"
    NETWORK_DEGRADED = "NetworkDegraded"


class Metadata(Record):
    name: Name
    org: Name


class AcceleratorRequest(Record):
    """Selects machines: at least `count` per machine; backend and model equal where given."""

    count: Annotated[int, msgspec.Meta(ge=0, le=64)] = 1
    backend: Backend | None = None
    model: Annotated[str, msgspec.Meta(min_length=1, max_length=64)] | None = None


class Image(Record):
    libc: Libc = "glibc"
    env: dict[str, str] = {}


class Distributed(Record):
    members: Annotated[int, msgspec.Meta(ge=MIN_MEMBERS, le=MAX_MEMBERS)]
    network: Network = "Global"
    transport: Transport = "Direct"


# `offering` or `provider/offering`, `*` matching anything, joined by '+': one pair of machine
# types (the placer's qualification table, `nodus qualify --offerings`).
PairPattern = Annotated[
    str, msgspec.Meta(pattern=r"^[a-z0-9*-]+(/[a-z0-9*-]+)?\+[a-z0-9*-]+(/[a-z0-9*-]+)?$")
]


class Qualify(Record):
    """A qualification run (G21, `nodus qualify`): placed on one pair of machines of these
    types, on this path only, whether or not the pair is qualified yet."""

    path: PathClass
    offerings: PairPattern


QUALIFY_ORG = "nodus-system"  # where `nodus qualify` runs its jobs


class JobSpec(Record):
    command: Annotated[list[str], msgspec.Meta(min_length=1)]
    distributed: Distributed
    env: dict[str, str] = {}
    image: Image = msgspec.field(default_factory=Image)
    accelerators: AcceleratorRequest = msgspec.field(default_factory=AcceleratorRequest)
    qualify: Qualify | None = None  # only in the org QUALIFY_ORG


class Condition(Record):
    type: ConditionType
    status: Literal["True", "False", "Unknown"]
    reason: str
    message: str
    last_transition_time: datetime


class GangMember(Record):
    rank: int
    node: str
    address: str
    # Relayed: which of the gang's two relays the member homes on (an index into
    # `GangStatus.relays`; when that is empty, into the first two live relays by name), chosen
    # by the placer so that members spread evenly across the relays.
    relay_slot: int | None = None


class Probe(Record):
    tcp_gbps: float
    rtt_ms: float
    path: str
    measured_time: datetime


class Estimate(Record):
    """What the scheduler assumed when it compared placements (G19); not a measurement."""

    relative_to_direct: float
    warning: str | None = None


class GangStatus(Record):
    transport: PathClass
    members: list[GangMember]
    estimate: Estimate | None = None
    probe: Probe | None = None
    relays: list[str] = []  # the gang's two relays by name (see Epoch.relays)


class Billing(Record):
    boot_seconds: float = 0.0
    run_seconds: float = 0.0
    mesh_relay_gi_b: float = msgspec.field(default=0.0, name="meshRelayGiB")


class LastEvent(Record):
    """The event of the transition that wrote this status, kept with it: a daemon killed after
    its write and before the event was stored publishes it again when it starts (the same
    `Nats-Msg-Id`, so the stream keeps one)."""

    kind: str
    message: str
    time: datetime
    seq: int  # the job's events, counted: its id is `<gang>:<created>:<seq>`
    epoch: int = 0  # the job's epoch when it happened


class JobStatus(Record):
    phase: Phase = Phase.PENDING
    epoch: int = 0
    gang: GangStatus | None = None
    conditions: list[Condition] = []
    billing: Billing | None = None
    placed_by: str | None = None
    created_time: datetime | None = None
    placed_time: datetime | None = None
    run_started_time: datetime | None = None
    finished_time: datetime | None = None
    # Machines a re-placement avoids: a pair that failed its probe, a member that was lost.
    avoid: list[str] = []
    # Of those, the members it lost (gone silent, a fault, a new boot): when no other machine
    # fits, the gang goes back to one that is healthy and free again rather than waiting for
    # ever (R16). A probe's suspect stays avoided (G12: re-placed without that pair).
    lost: list[str] = []
    # Set when a transport: Auto gang's direct path failed its probe: it continues as Relayed.
    path_override: PathClass | None = None
    # Epochs whose ranks were started: the next epoch's ranks are a restart if it is > 0, and
    # get it as NODUS_RESTART_COUNT (they resume from their checkpoint).
    runs: int = 0
    last_event: LastEvent | None = None
    # The events before the last (at most EARLIER_EVENTS_KEPT), published again the same way:
    # a daemon killed before its event was stored may find the job moved on when it starts.
    earlier_events: list[LastEvent] = []


EARLIER_EVENTS_KEPT = 7


class Job(Record):
    metadata: Metadata
    spec: JobSpec
    api_version: Literal["nodus/v1"] = "nodus/v1"
    kind: Literal["Job"] = "Job"
    status: JobStatus = msgspec.field(default_factory=JobStatus)

    @property
    def key(self) -> str:
        return job_key(self.metadata.org, self.metadata.name)

    def condition(self, kind: ConditionType) -> Condition | None:
        for condition in self.status.conditions:
            if condition.type == kind:
                return condition
        return None


def job_key(org: str, name: str) -> str:
    """The job's key in KV and its gang id in subjects: `org.name`."""
    return f"{org}.{name}"


def with_condition(
    status: JobStatus,
    kind: ConditionType,
    state: Literal["True", "False", "Unknown"],
    reason: str,
    message: str,
    when: datetime,
) -> JobStatus:
    """Set one condition; its transition time moves only when its status does."""
    conditions = []
    found = False
    for condition in status.conditions:
        if condition.type == kind:
            found = True
            moved = condition.status != state
            conditions.append(
                Condition(
                    type=kind,
                    status=state,
                    reason=reason,
                    message=message,
                    last_transition_time=when if moved else condition.last_transition_time,
                )
            )
        else:
            conditions.append(condition)
    if not found:
        conditions.append(
            Condition(
                type=kind, status=state, reason=reason, message=message, last_transition_time=when
            )
        )
    return msgspec.structs.replace(status, conditions=conditions)


class JobEvent(Record):
    """What the placer did to a job, on the events stream (`nodus.evt.job.<org>.<name>.<kind>`)."""

    gang: str
    kind: str
    epoch: int
    message: str
    time: datetime

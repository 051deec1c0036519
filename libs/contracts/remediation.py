"""Automated node repair (R1-R16): signals, alerts, recommendations, remediations, policy,
ladders, guardrail records, and the request/reply bodies of the remediator's API.

Every record here is desired or observed state kept in a KV bucket (names in `names.py`) and
written with compare-and-set, so replicas that race produce one outcome (R14)."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Literal

import msgspec

from libs.contracts.base import Name, Record

Severity = Literal["critical", "warning", "info"]

# A detector's or request's free-form id: safe in a KV key once hashed, bounded in size.
Token = Annotated[str, msgspec.Meta(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._:/@-]+$")]

MAX_EVIDENCE_LINES = 20  # raw lines kept per evidence item
MAX_EVIDENCE_ITEMS = 10  # evidence items kept per alert or remediation
IDLE_WAIT_DEFAULT_SECONDS = 2 * 3600.0  # R6: default max wait for idle
IDLE_WAIT_CAP_SECONDS = 24 * 3600.0  # R6: the longest max wait a policy may set


class AlertKind(StrEnum):
    """What was detected (R1). Inside the machine: Xid .. ReadonlyFilesystem; host side:
    Infiniband*, HostUnreachable; NodeNotReady is shown but never repairs alone (R3)."""

    XID = "Xid"
    GPU_OFF_BUS = "GpuOffBus"
    ECC_DOUBLE_BIT = "EccDoubleBit"
    ROW_REMAP_FAILURE = "RowRemapFailure"
    ROW_REMAP_PENDING = "RowRemapPending"
    THERMAL_THROTTLING = "ThermalThrottling"
    READONLY_FILESYSTEM = "ReadonlyFilesystem"
    INFINIBAND_PORT_DOWN = "InfinibandPortDown"
    INFINIBAND_FLAPPING = "InfinibandLinkFlapping"
    HOST_UNREACHABLE = "HostUnreachable"
    NODE_NOT_READY = "NodeNotReady"
    EXTERNAL = "External"


class Action(StrEnum):
    """Repairs, lightest first (R9). PowerCycle is the reboot rung with GPU power loss (R12)."""

    NONE = "None"
    REBOOT = "Reboot"
    POWER_CYCLE = "PowerCycle"
    REPROVISION = "Reprovision"
    MIGRATE = "Migrate"
    DELETE = "Delete"


class AlertState(StrEnum):
    FIRING = "Firing"
    RESOLVED = "Resolved"


class RemediationState(StrEnum):
    PENDING = "Pending"  # waits for a person's approval
    APPROVED = "Approved"
    WAITING_IDLE = "WaitingIdle"  # cordoned; waits for idle and the guardrails (R6, R13)
    RUNNING = "Running"
    REVALIDATING = "Revalidating"  # diagnostics before the node rejoins (R15)
    DONE = "Done"
    FAILED = "Failed"
    CANCELLED = "Cancelled"


TERMINAL_STATES = frozenset(
    {RemediationState.DONE, RemediationState.FAILED, RemediationState.CANCELLED}
)


class Outcome(StrEnum):
    """How a remediation ended; the ladder counts only Done and Failed (R10)."""

    DONE = "Done"
    FAILED = "Failed"
    CANCELLED = "Cancelled"
    SELF_RESOLVED = "SelfResolved"


# -- what detectors see ------------------------------------------------------------------------


class Evidence(Record):
    """Machine-readable proof of a failed health check (R2, R3): the raw lines or values, when,
    and where they were read."""

    kind: AlertKind
    source: str  # kmsg | dcgm | npd | infiniband | reachability | heartbeat | external:<name>
    node: str
    where: str  # a file path, URL, device or port
    observed_time: datetime
    severity: Severity = "warning"
    lines: list[str] = []
    values: dict[str, float] = {}
    labels: dict[str, str] = {}
    xid: int | None = None


class Finding(Record):
    """One thing a detector currently sees wrong. Reports are level-triggered: a finding that
    is absent from the next report of its source has cleared."""

    kind: AlertKind
    subject: str  # the component: a GPU's PCI address, an InfiniBand port, a mount point
    severity: Severity
    detail: str  # the source's own words (the Xid message, the NPD reason)
    evidence: Evidence
    xid: int | None = None


class SignalReport(Record):
    """One detector's view of one node, written to `nodus-signals` under `<node>.<source>`.
    The key's node must match `node` (S1); an older `observed_time` than the last is stale."""

    node: Name
    source: Name
    observed_time: datetime
    findings: list[Finding] = []
    boot_id: str = ""
    malformed: int = 0  # inputs the detector skipped as malformed since it started (S3)


# -- what the remediator keeps -----------------------------------------------------------------


class Alert(Record):
    """A detected fault with a stable summary, a plain description and evidence (R2); the same
    record feeds the CLI, the API and notifications (`nodus.evt.alert.<node>.<kind>`)."""

    id: str
    node: str
    kind: AlertKind
    subject: str
    severity: Severity
    summary: str
    description: str
    source: str
    action: Action  # the lightest action that fixes it, before the ladder (R4)
    state: AlertState
    first_seen_time: datetime
    last_seen_time: datetime
    # Start of the persistence window (R13): a signal that flaps does not reset it.
    window_start_time: datetime
    evidence: list[Evidence] = []
    cluster: str = ""
    pool: str = ""
    xid: int | None = None
    resolved_time: datetime | None = None
    flaps: int = 0
    # Bumps on a new episode and whenever a repair for it ends: names its next remediation.
    generation: int = 1
    boot_id: str = ""
    breaks_workload: bool = False  # R17: a running gang's member is lost at once


class Recommendation(Record):
    """What the platform advises for one firing alert that persisted (R4, R10, R11, R13);
    disappears when the alert clears."""

    id: str  # the alert's id
    alert_id: str
    node: str
    kind: AlertKind
    action: Action  # after the ladder and R11
    base_action: Action  # the catalog's lightest action
    rule: str  # the decision rule, readable
    summary: str
    severity: Severity
    generation: int
    created_time: datetime
    cluster: str = ""
    pool: str = ""
    xid: int | None = None
    ladder_key: str = ""
    evidence: list[Evidence] = []
    remediation_id: str | None = None
    breaks_workload: bool = False  # R17


class Requester(Record):
    """Who asked (R7, R8): a person, the automatic policy, or an external detector (recorded as
    such; it cannot claim to be a person). `via` says how: the API or the node's labels."""

    kind: Literal["human", "automatic", "external"]
    name: str
    detector: str | None = None
    request_id: str | None = None
    via: Literal["", "api", "label"] = ""


class Approver(Record):
    kind: Literal["human", "policy"]
    name: str
    rule: str = ""


class Transition(Record):
    state: RemediationState
    time: datetime
    by: str
    reason: str = ""


class Remediation(Record):
    """A repair as desired state (R14): one target node, its evidence (R3), who asked and who
    approved under which rule and when (R7), and where execution stands, so a replica that
    restarts resumes it without repeating a step."""

    id: str
    node: str
    action: Action
    requested_action: Action
    state: RemediationState
    requester: Requester
    rule: str
    evidence: list[Evidence]
    created_time: datetime
    cluster: str = ""
    pool: str = ""
    severity: Severity = "warning"
    reason: str = ""
    approver: Approver | None = None
    alert_ids: list[str] = []
    generation: int = 0
    ladder_key: str = ""
    kind: AlertKind = AlertKind.EXTERNAL
    xid: int | None = None
    approved_time: datetime | None = None
    wait_start_time: datetime | None = None
    idle_deadline_time: datetime | None = None  # None with never_interrupt: waits forever
    never_interrupt: bool = False
    started_time: datetime | None = None
    issued_time: datetime | None = None
    back_time: datetime | None = None  # the machine came back from the action
    finished_time: datetime | None = None
    outcome: Outcome | None = None
    op_id: str = ""
    executor: str = ""  # the replica that claimed the action; only it issues (R14)
    claim_time: datetime | None = None
    boot_id_before: str = ""
    host_before: str = ""
    host_after: str = ""
    issue_skipped: str = ""  # why the action was not issued (R12: the host already came back)
    provider_answer: str = ""  # what the machine provider answered (R18): BMC, command, agent
    interrupted: list[str] = []  # gangs still running when the max wait ran out (R6)
    diagnostics: list[str] = []
    history: list[Transition] = []
    settled: bool = False  # after the end: slots released, ladder and alerts updated
    breaks_workload: bool = False  # R17: no idle wait; the gang on it was restarted at once

    @property
    def active(self) -> bool:
        return self.state not in TERMINAL_STATES


# -- policy (R5, R6) ---------------------------------------------------------------------------


class IdleWait(Record):
    """Hold a repair until the node runs no job (R6)."""

    max_wait_seconds: Annotated[float, msgspec.Meta(ge=0, le=IDLE_WAIT_CAP_SECONDS)] = (
        IDLE_WAIT_DEFAULT_SECONDS
    )
    never_interrupt: bool = False  # wait without limit


class XidConsent(Record):
    """Consent for one Xid code: actions approved in advance, and actions a person approves
    even in automatic mode."""

    auto: list[Action] = []
    approve: list[Action] = []


class Policy(Record):
    """Per cluster (key `cluster.<name>`) or for every cluster (key `default`)."""

    mode: Literal["ApproveBeforeRepair", "Automatic"] = "ApproveBeforeRepair"
    trusted_actions: list[Action] = []  # the checklist that Automatic runs without a person
    xid_consent: dict[int, XidConsent] = {}
    idle: IdleWait = msgspec.field(default_factory=IdleWait)
    approval_required_nodes: list[str] = []  # per-node consent: these always wait for a person
    updated_by: str = ""
    updated_time: datetime | None = None


# -- ladders and guardrails (R10, R13) ---------------------------------------------------------


class LadderAttempt(Record):
    remediation_id: str
    action: Action
    time: datetime
    outcome: Outcome


class Ladder(Record):
    """Attempts per machine, cluster, alert kind and Xid code (R10)."""

    key: str
    node: str
    cluster: str
    kind: AlertKind
    xid: int | None = None
    attempts: list[LadderAttempt] = []


class BreakerEntry(Record):
    remediation_id: str
    time: datetime


class Breaker(Record):
    """Per cluster: opens on a surge of automatic repairs, stays open until a person resets it,
    and never replays what it held back (R13)."""

    cluster: str
    open: bool = False
    recent: list[BreakerEntry] = []
    opened_time: datetime | None = None
    opened_reason: str = ""
    held: list[str] = []  # remediation ids it turned back to a person's approval
    trips: int = 0
    reset_by: str = ""
    reset_time: datetime | None = None


class CordonHold(Record):
    by: str  # "remediator", "retired", or a person's or tool's name
    reason: str
    time: datetime
    remediation_id: str | None = None


class Cordon(Record):
    """A node with any hold is not placed on; each holder lifts only its own hold."""

    node: str
    holds: dict[str, CordonHold] = {}


class RepairSlots(Record):
    """Who holds a repair slot: `node.<n>` (one repair per node), `pool.<p>` (one per pool),
    `cluster.<c>` (the concurrency budget)."""

    scope: str
    holders: dict[str, datetime] = {}


# -- machines (the embedded local provider) ----------------------------------------------------


class MachineState(Record):
    """The provider's record of a machine: which host it runs on, whether it was retired."""

    node: str
    host_id: str
    retired: bool = False
    last_op_id: str = ""
    last_op_action: Action = Action.NONE
    last_op_time: datetime | None = None


class HostRecord(Record):
    """A physical host sent to revalidation (R15): diagnostics decide if it rejoins."""

    host_id: str
    node: str
    state: Literal["Revalidating", "Healthy", "Failed"]
    reason: str
    time: datetime
    findings: list[str] = []


# -- API bodies --------------------------------------------------------------------------------


class ApproveRequest(Record):
    id: str
    approver: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]


class CancelRequest(Record):
    id: str
    by: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    reason: str = ""


class RemediationReply(Record):
    remediation: Remediation
    created: bool = False


class RepairRequest(Record):
    """An external detector asks for a repair (R8); (detector, request_id) is idempotent. The
    detector is the one the request's subject names (the bus lets each detector's user speak
    only as itself); a body that names another is refused."""

    request_id: Token
    node: Name
    action: Action
    evidence: list[Evidence]
    reason: str = ""
    detector: Name | None = None


class PersonRepairRequest(Record):
    """A person asks for a repair (`nodus repair request --as`): requested and approved by that
    person, any action Delete included; the evidence gate holds (R3). A detector's bus user
    cannot send it (S1), so a detector cannot pass for a person."""

    by: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
    request_id: Token
    node: Name
    action: Action
    evidence: list[Evidence] = []
    reason: str = ""


# Node labels (R8): free-form labels on a node, and the repair contract on them.
LABEL_PREFIX = "repair.nodus.io/"
LABEL_ACTION = LABEL_PREFIX + "action"
LABEL_REQUEST_ID = LABEL_PREFIX + "request-id"
LABEL_REASON = LABEL_PREFIX + "reason"
LABEL_EVIDENCE = LABEL_PREFIX + "evidence"  # the detector's raw finding, one line
LABEL_SEVERITY = LABEL_PREFIX + "severity"
LABEL_REMEDIATION = LABEL_PREFIX + "remediation"  # written by Nodus: the repair it made


class NodeLabel(Record):
    value: str
    by: str  # who set it: the caller the bus named
    time: datetime


class NodeLabels(Record):
    """A node's labels (bucket `nodus-node-labels`, key = node), written only by the remediator's
    label API: agents own `nodus-nodes` and cannot set these."""

    node: Name
    labels: dict[str, NodeLabel] = {}


class LabelRequest(Record):
    """`nodus label node NAME KEY=VALUE ... KEY-`: set and remove labels in one change."""

    node: Name
    set: dict[str, str] = {}
    remove: list[str] = []
    overwrite: bool = False  # as kubectl: changing a label's value needs it


class LabelReply(Record):
    labels: NodeLabels
    remediation: Remediation | None = None
    created: bool = False


class BreakerResetRequest(Record):
    cluster: Name
    by: Annotated[str, msgspec.Meta(min_length=1, max_length=128)]


class BreakerReply(Record):
    breaker: Breaker


class RebootRequest(Record):
    """To a node's agent: the simulated machine boots again with a new boot id."""

    op_id: str
    power_cycle: bool = False


class RebootReply(Record):
    node: str
    boot_id: str


class SeenEvent(msgspec.Struct, kw_only=True):
    """One fault the log showed, as a monitor keeps it across restarts."""

    kind: AlertKind
    subject: str
    detail: str
    line: str
    xid: int | None = None
    pid: str | None = None
    process: str | None = None
    kernel_seconds: float | None = None
    first: datetime
    last: datetime
    count: int
    lines: list[str] = []


class KmsgCursor(msgspec.Struct, kw_only=True):
    """Where a reader of one boot's log got to, and what it had found by then."""

    boot_id: str
    seq: int
    seen: list[SeenEvent] = []

"""How repairs reach machines (R18): the remediator's `providers:` config, the records of the
actions providers carry out, and the requests the remediator sends a machine's agent (its own
reboot, its health check for revalidation).

A pool's provider is a `kind` (local, inband, redfish, exec) with per-action overrides, so one
pool can reboot in-band, power-cycle over its BMC and hand reprovision and delete to the
operator's own commands."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Literal

import msgspec

from libs.contracts.base import Record
from libs.contracts.remediation import Action


class ProviderKind(StrEnum):
    LOCAL = "local"  # the lab's stand-in: rewrites STATE_DIR/machines/NAME (nodus up only)
    INBAND = "inband"  # the agent drains its ranks and reboots its own host (systemd)
    REDFISH = "redfish"  # the BMC: power cycle, restart, one-time network boot
    EXEC = "exec"  # the operator's own command per action


# What each kind can carry out; the config is refused when a pool routes an action elsewhere.
SUPPORTED: dict[ProviderKind, frozenset[Action]] = {
    ProviderKind.LOCAL: frozenset(
        {Action.REBOOT, Action.POWER_CYCLE, Action.REPROVISION, Action.MIGRATE, Action.DELETE}
    ),
    # Only the lightest action goes in-band: the machine must still run its OS and agent.
    ProviderKind.INBAND: frozenset({Action.REBOOT}),
    # Reprovision = one-time network boot (PXE) and a restart; the installer does the rest.
    ProviderKind.REDFISH: frozenset({Action.REBOOT, Action.POWER_CYCLE, Action.REPROVISION}),
    ProviderKind.EXEC: frozenset(
        {Action.REBOOT, Action.POWER_CYCLE, Action.REPROVISION, Action.MIGRATE, Action.DELETE}
    ),
}

Seconds = Annotated[float, msgspec.Meta(gt=0, le=86400)]


BmcUrl = Annotated[str, msgspec.Meta(pattern=r"^https?://[^\s/]+(/[^\s]*)?$")]


class Bmc(Record):
    """One node's BMC: its Redfish service root and, when it manages several, the system."""

    address: BmcUrl
    system: str | None = None  # e.g. /redfish/v1/Systems/1; default: the only system


class RedfishSettings(Record):
    # A YAML/JSON file {username, password}, readable by the remediator only; never the config.
    credentials_file: str
    # node -> BMC (a URL, or {address, system}); nodes not listed use `address_template`.
    bmcs: dict[str, Bmc | BmcUrl] = {}
    # e.g. "https://{node}-bmc.mgmt.example.com": BMC names derived from node names.
    address_template: str | None = None
    # true, false (a lab's self-signed BMC) or a CA bundle path.
    verify_tls: bool | str = True
    timeout_seconds: Seconds = 30.0  # one HTTP request to the BMC
    # A power cycle waits this long for the system to report Off, then On.
    power_timeout_seconds: Seconds = 300.0
    # Held Off this long, so the GPUs lose power (Xid 79), before powering on again.
    off_seconds: Annotated[float, msgspec.Meta(ge=0, le=600)] = 10.0


class ExecSettings(Record):
    # Action -> argv of the operator's command; the request comes as JSON on its stdin.
    commands: dict[Action, Annotated[list[str], msgspec.Meta(min_length=1)]] = {}
    timeout_seconds: Seconds = 1800.0
    # A claim older than this whose run never recorded its answer (the replica died): the
    # action is failed for a person to look at, never run twice.
    claim_grace_seconds: Seconds = 60.0


class InbandSettings(Record):
    # The agent drains and reboots; its answer comes after the drain (the ranks' grace).
    timeout_seconds: Seconds = 60.0


class PoolProvider(Record):
    kind: ProviderKind
    # Per action, another kind than `kind` (e.g. {Reboot: inband, Delete: exec}).
    actions: dict[Action, ProviderKind] = {}
    redfish: RedfishSettings | None = None
    exec: ExecSettings | None = None
    inband: InbandSettings | None = None

    def kind_for(self, action: Action) -> ProviderKind:
        return self.actions.get(action, self.kind)


DEFAULT_POOL = "*"  # the entry for every pool not named


class RemediatorConfig(Record):
    """`nodus remediator --config FILE`: pool -> provider (DEFAULT_POOL for the rest)."""

    providers: dict[str, PoolProvider] = {}


# -- records -----------------------------------------------------------------------------------


class ProviderOp(Record):
    """One action a provider carried out, keyed by its op id (bucket `nodus-provider-ops`).

    Created (compare-and-set) before the action runs: that is the claim that makes it run once
    per op id whatever the replicas do (R14); the answer is recorded on it."""

    op_id: str
    node: str
    action: Action
    provider: ProviderKind
    state: Literal["Running", "Done", "Failed"]
    replica: str
    claim_time: datetime
    finished_time: datetime | None = None
    steps: list[str] = []  # what was done so far (a power cycle: off, on), for a retry
    exit_code: int | None = None
    stdout: str = ""
    stderr_tail: str = ""
    answer: str = ""  # readable: what the provider said, or why it failed
    host_id: str = ""  # after a migrate: the new host, when the provider names one
    retired: bool = False  # after a delete handed to a person


class ExecRequest(Record):
    """What the operator's command reads on its stdin (JSON, camelCase). Its environment also
    holds NODUS_IDEMPOTENCY_KEY (= opId), NODUS_NODE, NODUS_ACTION: a command run again with
    the same key must do nothing new (Nodus runs it once per key; a person might not)."""

    node: str
    action: Action
    op_id: str
    idempotency_key: str
    pool: str = ""
    cluster: str = ""
    remediation_id: str = ""
    requester: str = ""
    reason: str = ""
    evidence: list[str] = []  # one readable line per evidence item


class ExecAnswer(Record, forbid_unknown_fields=False):
    """What the command may print on stdout as a JSON object (anything else is kept as text)."""

    message: str = ""
    host: str = ""  # after a migrate: the new host's id
    retired: bool = False  # after a delete: the machine is out for good


# -- requests to a machine's agent --------------------------------------------------------------


class HostRebootRequest(Record):
    """In-band: drain the ranks and reboot this host (through systemd)."""

    op_id: str
    drain_seconds: Annotated[float, msgspec.Meta(ge=0, le=600)] = 10.0


class HostRebootReply(Record):
    node: str
    boot_id: str  # the boot the reboot leaves
    drained: int = 0  # ranks stopped first
    already: bool = False  # this op id rebooted the host before: not again


class HealthCheckRequest(Record):
    """Revalidation (R15) on the machine itself: run every detector from scratch and the
    agent's own checks, now."""

    op_id: str = ""


class HealthCheckReply(Record):
    node: str
    boot_id: str
    healthy: bool
    failures: list[str] = []  # readable; empty when healthy
    checks: list[str] = []  # what was checked
    checked_time: datetime | None = None


class Credentials(msgspec.Struct, forbid_unknown_fields=True):
    username: str
    password: str

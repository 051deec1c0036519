"""Node labels and the repair contract on them (R8), sans-I/O.

A detector sets `repair.nodus.io/action=reboot repair.nodus.io/request-id=...` (and the raw
finding under `repair.nodus.io/evidence`) on a node; that is a repair request from that
detector, the same as one through the API: idempotent on (detector, request id), Reboot,
Reprovision or Migrate only. Keys and values follow Kubernetes' label syntax, except the
reason and evidence, which are a line of free text."""

from __future__ import annotations

import re
from datetime import datetime

from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.remediation import (
    LABEL_ACTION,
    LABEL_EVIDENCE,
    LABEL_PREFIX,
    LABEL_REASON,
    LABEL_REMEDIATION,
    LABEL_REQUEST_ID,
    LABEL_SEVERITY,
    Action,
    AlertKind,
    Evidence,
    LabelRequest,
    NodeLabel,
    NodeLabels,
    RepairRequest,
)

_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_PREFIX = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
FREE_TEXT = (LABEL_REASON, LABEL_EVIDENCE)
FREE_TEXT_MAX = 512
OWNED_BY_NODUS = (LABEL_REMEDIATION,)  # what Nodus writes: a caller may not set or remove it
MAX_LABELS = 64
ACTIONS = {"reboot": Action.REBOOT, "reprovision": Action.REPROVISION, "migrate": Action.MIGRATE}
REFUSED_ACTIONS = {
    "delete": "delete is always a person's decision (R8, R9): `nodus repair request --as NAME "
    "--action delete`",
    "power-cycle": "a power cycle follows from the node's own Xid alert (R12), not a request",
}


def check_key(key: str) -> None:
    prefix, slash, name = key.rpartition("/")
    if (
        not _NAME.match(name)
        or len(name) > 63
        or (slash and (not _PREFIX.match(prefix) or len(prefix) > 253))
    ):
        raise NodusError(
            ErrorCode.INVALID,
            f"label key {key!r}: [PREFIX/]NAME, a DNS-subdomain prefix and a name of at most 63 "
            "letters, digits, '-', '_' or '.', beginning and ending with a letter or digit",
            field=f"$.set[{key!r}]",
        )


def check_value(key: str, value: str) -> None:
    if key in FREE_TEXT:
        if len(value) > FREE_TEXT_MAX or not value.isprintable():
            raise NodusError(
                ErrorCode.INVALID,
                f"label {key}: one line of printable text, at most {FREE_TEXT_MAX} characters",
                field=f"$.set[{key!r}]",
            )
        return
    if value and (not _NAME.match(value) or len(value) > 63):
        raise NodusError(
            ErrorCode.INVALID,
            f"label {key}={value!r}: at most 63 letters, digits, '-', '_' or '.', beginning "
            "and ending with a letter or digit",
            field=f"$.set[{key!r}]",
        )


def apply(
    current: NodeLabels | None, request: LabelRequest, caller: str, now: datetime
) -> NodeLabels:
    """The node's labels after the request; refuses it whole (nothing changes) on any error."""
    labels = dict(current.labels) if current else {}
    for key in request.remove:
        check_key(key)
        if key in OWNED_BY_NODUS:
            raise NodusError(ErrorCode.INVALID, f"label {key} is Nodus's own", field="$.remove")
        labels.pop(key, None)
    for key, value in request.set.items():
        check_key(key)
        check_value(key, value)
        if key in OWNED_BY_NODUS:
            raise NodusError(
                ErrorCode.INVALID, f"label {key} is Nodus's own", field=f"$.set[{key!r}]"
            )
        old = labels.get(key)
        if old is not None and old.value != value and not request.overwrite:
            raise NodusError(
                ErrorCode.CONFLICT,
                f"label {key} is already {old.value!r} (set by {old.by}); --overwrite changes it",
                field=f"$.set[{key!r}]",
            )
        if old is None or old.value != value:
            labels[key] = NodeLabel(value=value, by=caller, time=now)
    if len(labels) > MAX_LABELS:
        raise NodusError(ErrorCode.INVALID, f"a node has at most {MAX_LABELS} labels")
    return NodeLabels(node=request.node, labels=labels)


def asks_repair(request: LabelRequest) -> bool:
    """Does this change ask for a repair? Setting the action or the request id does; removing
    labels, or changing others, never repairs anything."""
    return LABEL_ACTION in request.set or LABEL_REQUEST_ID in request.set


def repair_request(labels: NodeLabels, detector: str) -> RepairRequest:
    """The repair the node's labels ask for, as the detector's request (R8)."""
    values = {key: label.value for key, label in labels.labels.items()}
    action_text = values.get(LABEL_ACTION, "").lower()
    request_id = values.get(LABEL_REQUEST_ID, "")
    if not action_text or not request_id:
        raise NodusError(
            ErrorCode.INVALID,
            f"a repair by label names both {LABEL_ACTION} and {LABEL_REQUEST_ID}",
            field=f"$.set[{LABEL_ACTION if not action_text else LABEL_REQUEST_ID!r}]",
        )
    if action_text in REFUSED_ACTIONS:
        raise NodusError(
            ErrorCode.INVALID,
            f"{LABEL_ACTION}={action_text} refused: {REFUSED_ACTIONS[action_text]}",
            field=f"$.set[{LABEL_ACTION!r}]",
        )
    action = ACTIONS.get(action_text)
    if action is None:
        raise NodusError(
            ErrorCode.INVALID,
            f"{LABEL_ACTION}={action_text}: one of {', '.join(ACTIONS)}",
            field=f"$.set[{LABEL_ACTION!r}]",
        )
    evidence = values.get(LABEL_EVIDENCE, "")
    if not evidence:
        raise NodusError(
            ErrorCode.INVALID,
            f"no failed health check: a repair by label carries {LABEL_EVIDENCE}=<the failed "
            "check's raw line> (no repair without one, R3)",
            field=f"$.set[{LABEL_EVIDENCE!r}]",
        )
    severity = values.get(LABEL_SEVERITY, "warning")
    if severity not in ("critical", "warning"):
        raise NodusError(
            ErrorCode.INVALID,
            f"{LABEL_SEVERITY}={severity}: critical or warning",
            field=f"$.set[{LABEL_SEVERITY!r}]",
        )
    return RepairRequest(
        request_id=request_id,
        node=labels.node,
        action=action,
        detector=detector,
        reason=values.get(LABEL_REASON, ""),
        evidence=[
            Evidence(
                kind=AlertKind.EXTERNAL,
                source=f"external:{detector}",
                node=labels.node,
                where=f"node label {LABEL_EVIDENCE}",
                observed_time=labels.labels[LABEL_EVIDENCE].time,
                severity="critical" if severity == "critical" else "warning",
                lines=[evidence],
                labels={k: v for k, v in values.items() if k.startswith(LABEL_PREFIX)},
            )
        ],
    )


def with_remediation(labels: NodeLabels, remediation_id: str, now: datetime) -> NodeLabels:
    """Nodus notes on the node the repair its labels made."""
    changed = dict(labels.labels)
    changed[LABEL_REMEDIATION] = NodeLabel(value=remediation_id, by="nodus", time=now)
    return NodeLabels(node=labels.node, labels=changed)

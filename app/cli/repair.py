"""`nodus` commands for automated node repair:

    nodus get alerts|recommendations|remediations [-o json|yaml] [--node N]
    nodus describe remediation|alert ID
    nodus approve ID            nodus cancel ID
    nodus policy get|set        nodus repair request ...
    nodus breaker get|reset CLUSTER

(`nodus policy` is in `app.cli.policy`, `nodus fault` in `app.cli.faults`; the daemons `remediator` and `monitor` in
`app.cli.daemons`.)"""

from __future__ import annotations

import argparse
import os
import re
import sys
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import datetime
from typing import Any

import msgspec

from app.cli.common import (
    Command,
    Kind,
    age,
    client_flags,
    emit,
    group,
    indented,
    output_flag,
    run_async,
    short,
)
from app.output import table, to_yaml
from libs.bus import Bus
from libs.bus.auth import DETECTOR_INBOX, detector_of
from libs.client.client import client_credentials
from libs.contracts import names
from libs.contracts.base import convert, now
from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.remediation import (
    Action,
    Alert,
    AlertKind,
    ApproveRequest,
    Breaker,
    BreakerReply,
    BreakerResetRequest,
    CancelRequest,
    Evidence,
    PersonRepairRequest,
    Recommendation,
    Remediation,
    RemediationReply,
    RepairRequest,
)

BUCKETS = [
    names.BUCKET_ALERTS,
    names.BUCKET_RECOMMENDATIONS,
    names.BUCKET_REMEDIATIONS,
    names.BUCKET_REMEDIATION_POLICY,
    names.BUCKET_BREAKERS,
]


def parse_action(text: str) -> Action:
    wanted = text.replace("-", "").replace("_", "").lower()
    for action in Action:
        if action.value.lower() == wanted:
            return action
    raise argparse.ArgumentTypeError(
        f"unknown action {text!r}; one of reboot, power-cycle, reprovision, migrate, delete"
    )


def parse_duration(text: str) -> float:
    """`2h`, `90m`, `45s`, `3600`."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([hms]?)\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 2h, 90m, 3600)")
    return float(match.group(1)) * {"h": 3600, "m": 60, "s": 1, "": 1}[match.group(2)]


def who_flag(parser: argparse.ArgumentParser, help: str | None = None) -> None:
    """`--as NAME`: who acts, for the audit trail."""
    default = os.environ.get("NODUS_USER") or os.environ.get("USER") or "cli"
    parser.add_argument("--as", dest="who", default=default, help=help)


def repair_flags(parser: argparse.ArgumentParser) -> None:
    """How a repair command reaches the bus: no `--org`, repairs are of nodes, not jobs."""
    client_flags(parser, org=False)


@asynccontextmanager
async def open_bus(
    args: argparse.Namespace,
    buckets: list[str] | None = BUCKETS,
    inbox_prefix: str | None = None,
) -> AsyncIterator[Bus]:
    bus = await Bus.open(
        args.nats,
        name="nodus-client",
        credentials=args.credentials or client_credentials(),
        buckets=buckets,
        inbox_prefix=inbox_prefix,
    )
    try:
        yield bus
    finally:
        await bus.close()


async def _request(
    args: argparse.Namespace, subject: str, body: msgspec.Struct, reply: type[Any]
) -> Any:
    async with open_bus(args, buckets=None) as bus:
        return await bus.request(subject, body, reply, timeout=10.0)


def _time(when: datetime | None) -> str:
    return f"{when:%Y-%m-%dT%H:%M:%SZ}" if when else "-"


# -- get -----------------------------------------------------------------------------------------


async def _get_alerts(args: argparse.Namespace) -> int:
    async with open_bus(args) as bus:
        found = await bus.bucket(names.BUCKET_ALERTS, Alert).snapshot()
    alerts = sorted(
        (a.value for a in found.values()), key=lambda a: (a.state.value, a.node, a.first_seen_time)
    )
    alerts = [
        a
        for a in alerts
        if (args.all or a.state.value == "Firing") and (not args.node or a.node == args.node)
    ]
    if not emit([msgspec.to_builtins(a) for a in alerts], args.output):
        rows = [
            [
                a.id,
                a.severity,
                a.state.value,
                a.action.value,
                age(a.first_seen_time),
                short(a.summary, 70),
            ]
            for a in alerts
        ]
        print(table(["ID", "SEVERITY", "STATE", "ACTION", "AGE", "SUMMARY"], rows))
    return 0


async def _get_recommendations(args: argparse.Namespace) -> int:
    async with open_bus(args) as bus:
        found = await bus.bucket(names.BUCKET_RECOMMENDATIONS, Recommendation).snapshot()
    recs = sorted(
        (r.value for r in found.values() if not args.node or r.value.node == args.node),
        key=lambda r: (r.node, r.id),
    )
    if not emit([msgspec.to_builtins(r) for r in recs], args.output):
        rows = [
            [
                r.id,
                r.action.value,
                r.remediation_id or "-",
                age(r.created_time),
                short(r.rule, 70),
            ]
            for r in recs
        ]
        print(table(["ID", "ACTION", "REMEDIATION", "AGE", "RULE"], rows))
    return 0


async def _remediations(args: argparse.Namespace) -> list[Remediation]:
    async with open_bus(args) as bus:
        found = await bus.bucket(names.BUCKET_REMEDIATIONS, Remediation).snapshot()
    return sorted((r.value for r in found.values()), key=lambda r: r.created_time)


async def _get_remediations(args: argparse.Namespace) -> int:
    rems = [
        r
        for r in await _remediations(args)
        if (args.all or r.active or (now() - (r.finished_time or now())).total_seconds() < 86400)
        and (not args.node or r.node == args.node)
    ]
    if not emit([msgspec.to_builtins(r) for r in rems], args.output):
        rows = [
            [
                r.id,
                r.action.value,
                r.state.value,
                r.requester.name,
                r.approver.name if r.approver else "-",
                age(r.created_time),
                short(r.reason, 60),
            ]
            for r in rems
        ]
        print(table(["ID", "ACTION", "STATE", "REQUESTER", "APPROVER", "AGE", "REASON"], rows))
    return 0


async def _get_remediation(args: argparse.Namespace) -> int:
    if not args.name:
        print("error: `nodus get remediation` needs an ID", file=sys.stderr)
        return 2
    rems = [r for r in await _remediations(args) if r.id == args.name]
    if not rems:
        raise NodusError(ErrorCode.NOT_FOUND, f"remediation {args.name} not found")
    document = msgspec.to_builtins(rems[0])
    if not emit(document, args.output):
        print(to_yaml(document))
    return 0


GET_KINDS = [
    Kind("alerts", _get_alerts),
    Kind("recommendations", _get_recommendations),
    Kind("remediations", _get_remediations),
    Kind("remediation", _get_remediation),
]

# -- describe ------------------------------------------------------------------------------------


def _evidence_lines(evidence: list[Evidence]) -> list[str]:
    lines = []
    for item in evidence:
        lines.append(
            f"  - {item.kind.value} from {item.source} at {item.where} "
            f"({item.observed_time:%Y-%m-%dT%H:%M:%SZ}, {item.severity})"
        )
        lines.extend(f"      {line}" for line in item.lines[-5:])
        if item.values:
            lines.append("      " + ", ".join(f"{k}={v:g}" for k, v in sorted(item.values.items())))
    return lines


def _alert_lines(a: Alert) -> list[str]:
    return [
        f"ID:           {a.id}",
        f"Summary:      {a.summary}",
        f"Description:  {a.description}",
        f"Node:         {a.node} (cluster {a.cluster or '-'}, pool {a.pool or '-'})",
        f"Severity:     {a.severity}",
        f"State:        {a.state.value}",
        f"Action:       {a.action.value}",
        f"First seen:   {_time(a.first_seen_time)}",
        f"Last seen:    {_time(a.last_seen_time)}",
        f"Window from:  {_time(a.window_start_time)} (flaps {a.flaps})",
        "Evidence:",
        *_evidence_lines(a.evidence),
    ]


async def _describe_alert(args: argparse.Namespace) -> int:
    async with open_bus(args) as bus:
        found = await bus.bucket(names.BUCKET_ALERTS, Alert).get(args.name)
    if found is None:
        raise NodusError(ErrorCode.NOT_FOUND, f"alert {args.name} not found")
    print("\n".join(_alert_lines(found.value)))
    return 0


def _remediation_lines(r: Remediation) -> list[str]:
    via = {"label": ", by node label", "api": ", through the API"}.get(r.requester.via, "")
    requester = r.requester.name + (
        f" (detector {r.requester.detector}, request {r.requester.request_id}{via})"
        if r.requester.kind == "external"
        else " (a person)"
        if r.requester.kind == "human"
        else ""
    )
    approver = f"{r.approver.kind} {r.approver.name}: {r.approver.rule}" if r.approver else "-"
    action = r.action.value
    if r.requested_action is not r.action:
        action += f" (requested {r.requested_action.value})"
    lines = [
        f"ID:           {r.id}",
        f"Node:         {r.node} (cluster {r.cluster or '-'}, pool {r.pool or '-'})",
        f"Action:       {action}",
        f"State:        {r.state.value}" + (f" ({r.outcome.value})" if r.outcome else ""),
        f"Reason:       {r.reason}",
        f"Requester:    {r.requester.kind}: {requester}",
        f"Approver:     {approver}",
        f"Rule:         {r.rule}",
        f"Alerts:       {', '.join(r.alert_ids) or '-'}",
        f"Created:      {_time(r.created_time)}",
        f"Approved:     {_time(r.approved_time)}",
        f"Started:      {_time(r.started_time)}",
        f"Finished:     {_time(r.finished_time)}",
    ]
    if r.interrupted:
        lines.append(f"Interrupted:  {', '.join(r.interrupted)}")
    if r.issue_skipped:
        lines.append(f"Not issued:   {r.issue_skipped}")
    if r.host_after and r.host_after != r.host_before:
        lines.append(f"Host:         {r.host_before} -> {r.host_after}")
    if r.diagnostics:
        lines.append("Diagnostics:")
        lines.extend(f"  - {d}" for d in r.diagnostics)
    lines.append("Evidence:")
    lines.extend(_evidence_lines(r.evidence))
    lines.append("History:")
    lines += indented(
        table(
            ["TIME", "STATE", "BY", "REASON"],
            [[_time(h.time), h.state.value, h.by, short(h.reason, 80)] for h in r.history],
        )
    )
    return lines


async def _describe_remediation(args: argparse.Namespace) -> int:
    """A remediation by its id, or by the id of the recommendation that made it."""
    async with open_bus(args) as bus:
        rems = bus.bucket(names.BUCKET_REMEDIATIONS, Remediation)
        found = await rems.get(args.name)
        if found is None:
            rec = await bus.bucket(names.BUCKET_RECOMMENDATIONS, Recommendation).get(args.name)
            if rec is not None and rec.value.remediation_id:
                found = await rems.get(rec.value.remediation_id)
    if found is None:
        raise NodusError(ErrorCode.NOT_FOUND, f"remediation {args.name} not found")
    print("\n".join(_remediation_lines(found.value)))
    return 0


DESCRIBE_KINDS = [Kind("remediation", _describe_remediation), Kind("alert", _describe_alert)]

# -- approve, cancel -----------------------------------------------------------------------------


def _approve_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("id")
    who_flag(parser, help="your name in the audit trail")
    repair_flags(parser)


async def _approve(args: argparse.Namespace) -> int:
    reply: RemediationReply = await _request(
        args,
        names.API_REMEDIATION_APPROVE,
        ApproveRequest(id=args.id, approver=args.who),
        RemediationReply,
    )
    r = reply.remediation
    print(f"remediation/{r.id} {r.state.value}: {r.action.value} of {r.node} ({r.reason})")
    return 0


def _cancel_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("id")
    parser.add_argument("--reason", default="")
    who_flag(parser)
    repair_flags(parser)


async def _cancel(args: argparse.Namespace) -> int:
    reply: RemediationReply = await _request(
        args,
        names.API_REMEDIATION_CANCEL,
        CancelRequest(id=args.id, by=args.who, reason=args.reason),
        RemediationReply,
    )
    print(f"remediation/{reply.remediation.id} {reply.remediation.state.value}")
    return 0


# -- breaker -------------------------------------------------------------------------------------


def _breaker_get_flags(parser: argparse.ArgumentParser) -> None:
    output_flag(parser, "json|yaml|jsonpath=... (default: a table)")
    repair_flags(parser)


async def _breaker_get(args: argparse.Namespace) -> int:
    async with open_bus(args) as bus:
        found = await bus.bucket(names.BUCKET_BREAKERS, Breaker).snapshot()
    breakers = [b.value for b in found.values()]
    if not emit([msgspec.to_builtins(b) for b in breakers], args.output):
        rows = [
            [
                b.cluster,
                "Open" if b.open else "Closed",
                str(b.trips),
                str(len(b.held)),
                short(b.opened_reason or (f"reset by {b.reset_by}" if b.reset_by else ""), 70),
            ]
            for b in breakers
        ]
        print(table(["CLUSTER", "STATE", "TRIPS", "HELD", "REASON"], rows))
    return 0


def _breaker_reset_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("cluster")
    who_flag(parser)
    repair_flags(parser)


async def _breaker_reset(args: argparse.Namespace) -> int:
    reply: BreakerReply = await _request(
        args,
        names.API_REMEDIATION_BREAKER_RESET,
        BreakerResetRequest(cluster=args.cluster, by=args.who),
        BreakerReply,
    )
    held = len(reply.breaker.held)
    print(
        f"breaker/{args.cluster} closed by {args.who}"
        + (f"; {held} repairs it held stay with people (not replayed)" if held else "")
    )
    return 0


# -- repair request ------------------------------------------------------------------------------


def _repair_request_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--node", required=True)
    parser.add_argument("--action", type=parse_action, required=True)
    parser.add_argument(
        "--detector",
        help="ask as this external detector (R8); a detector's own credentials name it. "
        "Without it, operator credentials ask as the person --as names",
    )
    parser.add_argument(
        "--request-id",
        help="the idempotency key: the same id asks for the same repair (a detector's is "
        "required; a person's is made up when absent)",
    )
    parser.add_argument("--line", action="append", default=[], help="a raw evidence line")
    parser.add_argument("--value", action="append", default=[], metavar="NAME=NUMBER")
    parser.add_argument("--where", default="", help="where the evidence was read")
    parser.add_argument("--severity", choices=["critical", "warning"], default="warning")
    parser.add_argument("--reason", default="")
    who_flag(parser, "a person asking: recorded as requester and approver")
    output_flag(parser, "json|yaml|jsonpath=... (default: one line)")
    repair_flags(parser)


def _evidence_of(args: argparse.Namespace, source: str) -> list[Evidence]:
    values = {}
    for item in args.value:
        name, _, number = item.partition("=")
        try:
            values[name] = float(number)
        except ValueError:
            raise NodusError(ErrorCode.INVALID, f"--value {item!r}: not NAME=NUMBER") from None
    if not (args.line or values):
        return []
    return [
        Evidence(
            kind=AlertKind.EXTERNAL,
            source=source,
            node=args.node,
            where=args.where or source,
            observed_time=now(),
            severity=args.severity,
            lines=args.line,
            values=values,
        )
    ]


def _checked(request: msgspec.Struct) -> Any:
    try:
        return convert(msgspec.to_builtins(request), type(request))
    except msgspec.ValidationError as error:
        raise NodusError(ErrorCode.INVALID, str(error)) from None


async def _repair_request(args: argparse.Namespace) -> int:
    from app.cli.labels import detector_named  # labels builds on this module

    async with open_bus(args, buckets=None, inbox_prefix=DETECTOR_INBOX) as bus:
        detector = detector_named(detector_of(await bus.user_info()), args.detector)
        if detector is not None:
            if not args.request_id:
                raise NodusError(
                    ErrorCode.INVALID, "a detector's request carries --request-id (R8)"
                )
            body: msgspec.Struct = RepairRequest(
                request_id=args.request_id,
                node=args.node,
                action=args.action,
                evidence=_evidence_of(args, f"external:{detector}"),
                reason=args.reason,
            )
            subject = names.caller_subject(names.API_REMEDIATION_EXTERNAL, detector)
        else:
            body = PersonRepairRequest(
                by=args.who,
                request_id=args.request_id or uuid.uuid4().hex[:12],
                node=args.node,
                action=args.action,
                evidence=_evidence_of(args, f"person:{args.who}"),
                reason=args.reason,
            )
            subject = names.API_REMEDIATION_REQUEST
        reply: RemediationReply = await bus.request(
            subject, _checked(body), RemediationReply, timeout=10.0
        )
    if emit(msgspec.to_builtins(reply.remediation), args.output):
        return 0
    r = reply.remediation
    print(
        f"remediation/{r.id} {'created' if reply.created else 'exists (same request)'}: "
        f"{r.action.value} of {r.node}, {r.state.value}, requested by {r.requester.name}"
    )
    return 0


APPROVE = Command(
    "approve",
    "approve a pending repair (remediation or alert id)",
    _approve_flags,
    run_async(_approve),
)
CANCEL = Command(
    "cancel", "cancel a repair that has not started", _cancel_flags, run_async(_cancel)
)
REPAIR = group(
    "repair",
    "ask for a repair: as an external detector (R8) or as a person",
    "repair_command",
    [
        Command(
            "request",
            "ask for a repair with evidence",
            _repair_request_flags,
            run_async(_repair_request),
            description="Ask the remediator for a repair. As an external detector (a "
            "detector's credentials, or --detector): recorded as such, idempotent on (detector, "
            "request id), Reboot, Reprovision or Migrate only; it skips approval but passes the "
            "evidence gate, the capacity check, the budget and the per-cluster cap. As a person "
            "(operator credentials, --as NAME): recorded as that person, who approves it by "
            "asking; any action, Delete included; the evidence gate holds (the node's firing "
            "alerts count).",
        )
    ],
)
BREAKER = group(
    "breaker",
    "a cluster's circuit breaker (R13)",
    "breaker_command",
    [
        Command("get", "every cluster's breaker", _breaker_get_flags, run_async(_breaker_get)),
        Command(
            "reset",
            "close it; what it held back stays with people (not replayed)",
            _breaker_reset_flags,
            run_async(_breaker_reset),
        ),
    ],
)


def commands() -> list[Command]:
    """The repair commands in `nodus --help` order, `nodus policy` among them (app.cli.policy
    builds on this module, so it is imported here, not at the top)."""
    from app.cli.faults import FAULT
    from app.cli.labels import LABEL
    from app.cli.policy import POLICY

    return [APPROVE, CANCEL, POLICY, REPAIR, LABEL, BREAKER, FAULT]

"""`nodus` commands for automated node repair:

    nodus get alerts|recommendations|remediations [-o json|yaml] [--node N]
    nodus describe remediation ID
    nodus approve ID            nodus cancel ID
    nodus policy get|set        nodus repair request ...
    nodus breaker get|reset CLUSTER
    nodus fault inject NODE KIND [...]     nodus fault clear NODE [KIND]
    nodus remediator ...        nodus monitor ...        (daemons)

`register(sub)` adds them to the CLI's parser; `dispatch(args)` runs one, or returns None when
the command is not one of these."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec
import yaml

from libs.bus import Bus
from libs.bus.connection import DEFAULT_URL
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
    Policy,
    Recommendation,
    Remediation,
    RemediationReply,
    RepairRequest,
)

KINDS = ["alerts", "alert", "recommendations", "remediations", "remediation"]
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


def _who() -> str:
    return os.environ.get("NODUS_USER") or os.environ.get("USER") or "cli"


def _client_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nats",
        default=os.environ.get("NODUS_NATS_URL", DEFAULT_URL),
        help=f"bus URL (env NODUS_NATS_URL; default {DEFAULT_URL})",
    )
    parser.add_argument("--credentials", default=os.environ.get("NODUS_NATS_CREDS"))


def _state_dir_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=Path(os.environ.get("NODUS_STATE_DIR", ".nodus")),
        help="`nodus up`'s state dir: machine files under STATE_DIR/machines/NAME (default .nodus)",
    )


def _extend_choices(sub: argparse._SubParsersAction[Any], command: str, extra: list[str]) -> None:
    parser = sub.choices.get(command)
    if parser is None:
        return
    for action in parser._actions:
        if action.dest == "kind" and isinstance(action.choices, list):
            action.choices.extend(c for c in extra if c not in action.choices)
            return


def register(sub: argparse._SubParsersAction[Any]) -> None:
    _extend_choices(sub, "get", ["alerts", "recommendations", "remediations", "remediation"])
    _extend_choices(sub, "describe", ["remediation", "alert"])
    get = sub.choices.get("get")
    if get is not None:
        get.add_argument("--node", help="alerts, recommendations, remediations: of one node")
        get.add_argument(
            "--all", action="store_true", help="alerts and remediations: resolved and ended too"
        )

    approve = sub.add_parser("approve", help="approve a pending repair (remediation or alert id)")
    approve.add_argument("id")
    approve.add_argument("--as", dest="who", default=_who(), help="your name in the audit trail")
    _client_flags(approve)

    cancel = sub.add_parser("cancel", help="cancel a repair that has not started")
    cancel.add_argument("id")
    cancel.add_argument("--reason", default="")
    cancel.add_argument("--as", dest="who", default=_who())
    _client_flags(cancel)

    pol = sub.add_parser("policy", help="the automatic repair policy (R5, R6)")
    pol_sub = pol.add_subparsers(dest="policy_command", required=True, metavar="get|set")
    pol_get = pol_sub.add_parser("get", help="show the policy")
    pol_get.add_argument("--cluster", help="a cluster's own policy (default: the default one)")
    pol_get.add_argument("-o", "--output", default="yaml", help="yaml|json")
    _client_flags(pol_get)
    pol_set = pol_sub.add_parser(
        "set",
        help="change the policy",
        description="Change the repair policy; flags not given keep their value. Approve-"
        "before-repair is the default; `--mode automatic --trust reboot,power-cycle` runs "
        "those actions without a person; `--xid 119=reboot` approves a reboot for Xid 119 in "
        "advance, `--xid-approve 95=migrate` always asks a person.",
    )
    pol_set.add_argument("--cluster", help="set a cluster's own policy")
    pol_set.add_argument("-f", "--filename", type=Path, help="the whole policy, YAML or JSON")
    pol_set.add_argument("--mode", choices=["approve", "automatic"])
    pol_set.add_argument("--trust", help="the trusted actions of automatic mode, comma-separated")
    pol_set.add_argument("--xid", action="append", default=[], metavar="CODE=ACTION[,ACTION]")
    pol_set.add_argument(
        "--xid-approve", action="append", default=[], metavar="CODE=ACTION[,ACTION]"
    )
    pol_set.add_argument("--idle-max-wait", type=parse_duration, help="e.g. 2h (cap 24h)")
    never = pol_set.add_mutually_exclusive_group()
    never.add_argument("--never-interrupt", action="store_true", default=None)
    never.add_argument("--interrupt", dest="never_interrupt", action="store_false")
    pol_set.add_argument(
        "--approval-node", action="append", default=None, help="a node that always needs a person"
    )
    pol_set.add_argument("--as", dest="who", default=_who())
    _client_flags(pol_set)

    repair = sub.add_parser("repair", help="external detectors: request a repair (R8)")
    repair_sub = repair.add_subparsers(dest="repair_command", required=True, metavar="request")
    request = repair_sub.add_parser(
        "request",
        help="ask for a repair with evidence",
        description="Ask the remediator for a repair as an external detector: recorded as "
        "such, idempotent on (detector, request id), Reboot, Reprovision or Migrate only; it "
        "skips approval but passes the evidence gate, the capacity check, the budget and the "
        "per-cluster cap.",
    )
    request.add_argument("--detector", required=True)
    request.add_argument("--request-id", required=True)
    request.add_argument("--node", required=True)
    request.add_argument("--action", type=parse_action, required=True)
    request.add_argument("--line", action="append", default=[], help="a raw evidence line")
    request.add_argument("--value", action="append", default=[], metavar="NAME=NUMBER")
    request.add_argument("--where", default="", help="where the evidence was read")
    request.add_argument("--severity", choices=["critical", "warning"], default="warning")
    request.add_argument("--reason", default="")
    request.add_argument("-o", "--output", default="", help="json")
    _client_flags(request)

    breaker = sub.add_parser("breaker", help="a cluster's circuit breaker (R13)")
    breaker_sub = breaker.add_subparsers(dest="breaker_command", required=True, metavar="get|reset")
    breaker_get = breaker_sub.add_parser("get", help="every cluster's breaker")
    breaker_get.add_argument("-o", "--output", default="")
    _client_flags(breaker_get)
    breaker_reset = breaker_sub.add_parser(
        "reset", help="close it; what it held back stays with people (not replayed)"
    )
    breaker_reset.add_argument("cluster")
    breaker_reset.add_argument("--as", dest="who", default=_who())
    _client_flags(breaker_reset)

    from services.remediator.faults import KINDS as FAULTS

    fault = sub.add_parser("fault", help="write a fault into a local machine's files (demos)")
    fault_sub = fault.add_subparsers(dest="fault_command", required=True, metavar="inject|clear")
    inject = fault_sub.add_parser(
        "inject",
        help="write a fault in its real format",
        description="Write a fault the way the kernel, dcgm-exporter, Node Problem Detector or "
        "sysfs write it, into STATE_DIR/machines/NODE/. Kinds: " + ", ".join(FAULTS) + ".",
    )
    inject.add_argument("node")
    inject.add_argument("kind", choices=FAULTS)
    inject.add_argument("--xid", type=int, default=79)
    inject.add_argument("--gpu", type=int, default=0, help="GPU index")
    inject.add_argument("--port", default="mlx5_0/1", help="InfiniBand device/port")
    inject.add_argument("--count", type=int, default=1, help="ECC errors, or link flaps")
    inject.add_argument(
        "--sticky", action="store_true", help="hardware: survives reboots and reprovisions"
    )
    _state_dir_flag(inject)
    clear = fault_sub.add_parser("clear", help="undo injected faults")
    clear.add_argument("node")
    clear.add_argument("kind", nargs="?", choices=FAULTS)
    _state_dir_flag(clear)

    from services.remediator.main import build_parser as remediator_parser
    from services.remediator.monitor import build_parser as monitor_parser

    remediator_parser(sub.add_parser("remediator", help="daemon: automated node repair"))
    monitor_parser(sub.add_parser("monitor", help="daemon: the fault detectors of machines"))


def dispatch(args: argparse.Namespace) -> int | None:
    command = args.command
    if command == "remediator":
        from services.remediator.main import run

        return run(args)
    if command == "monitor":
        from services.remediator.monitor import run as run_monitor

        return run_monitor(args)
    if command == "fault":
        return _fault(args)
    body: Callable[[argparse.Namespace], Coroutine[Any, Any, int]] | None = None
    if command == "get" and args.kind in KINDS:
        body = _get
    elif command == "describe" and args.kind in ("remediation", "alert"):
        body = _describe
    elif command in ("approve", "cancel", "policy", "repair", "breaker"):
        body = {
            "approve": _approve,
            "cancel": _cancel,
            "policy": _policy,
            "repair": _repair,
            "breaker": _breaker,
        }[command]
    if body is None:
        return None
    try:
        return asyncio.run(body(args))
    except NodusError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


# -- helpers -------------------------------------------------------------------------------------


async def _open(args: argparse.Namespace) -> Bus:
    return await Bus.open(
        args.nats, name="nodus-client", credentials=args.credentials, buckets=BUCKETS
    )


def _age(when: datetime | None) -> str:
    if when is None:
        return "-"
    seconds = int((datetime.now(UTC) - when).total_seconds())
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    if seconds < 172800:
        return f"{seconds // 3600}h"
    return f"{seconds // 86400}d"


def _print(document: Any, output: str) -> bool:
    from app.output import jsonpath, to_json, to_yaml

    if output == "json":
        print(to_json(document))
    elif output == "yaml":
        print(to_yaml(document))
    elif output.startswith("jsonpath="):
        print(jsonpath(output.removeprefix("jsonpath=").strip("'\""), document))
    else:
        return False
    return True


def _short(text: str, width: int = 60) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


# -- get and describe ----------------------------------------------------------------------------


async def _get(args: argparse.Namespace) -> int:
    from app.output import table

    bus = await _open(args)
    try:
        if args.kind in ("alerts", "alert"):
            found = await bus.bucket(names.BUCKET_ALERTS, Alert).snapshot()
            alerts = sorted(
                (a.value for a in found.values()),
                key=lambda a: (a.state.value, a.node, a.first_seen_time),
            )
            alerts = [
                a
                for a in alerts
                if (args.all or a.state.value == "Firing")
                and (not args.node or a.node == args.node)
            ]
            if not _print([msgspec.to_builtins(a) for a in alerts], args.output):
                rows = [
                    [
                        a.id,
                        a.severity,
                        a.state.value,
                        a.action.value,
                        _age(a.first_seen_time),
                        _short(a.summary, 70),
                    ]
                    for a in alerts
                ]
                print(table(["ID", "SEVERITY", "STATE", "ACTION", "AGE", "SUMMARY"], rows))
            return 0
        if args.kind == "recommendations":
            found_recs = await bus.bucket(names.BUCKET_RECOMMENDATIONS, Recommendation).snapshot()
            recs = sorted(
                (
                    r.value
                    for r in found_recs.values()
                    if not args.node or r.value.node == args.node
                ),
                key=lambda r: (r.node, r.id),
            )
            if not _print([msgspec.to_builtins(r) for r in recs], args.output):
                rows = [
                    [
                        r.id,
                        r.action.value,
                        r.remediation_id or "-",
                        _age(r.created_time),
                        _short(r.rule, 70),
                    ]
                    for r in recs
                ]
                print(table(["ID", "ACTION", "REMEDIATION", "AGE", "RULE"], rows))
            return 0
        found_rems = await bus.bucket(names.BUCKET_REMEDIATIONS, Remediation).snapshot()
        rems = sorted((r.value for r in found_rems.values()), key=lambda r: r.created_time)
        if args.kind == "remediation":
            if not args.name:
                print("error: `nodus get remediation` needs an ID", file=sys.stderr)
                return 2
            rems = [r for r in rems if r.id == args.name]
            if not rems:
                raise NodusError(ErrorCode.NOT_FOUND, f"remediation {args.name} not found")
            if not _print(msgspec.to_builtins(rems[0]), args.output or "yaml"):
                return 2
            return 0
        rems = [
            r
            for r in rems
            if (
                args.all or r.active or (now() - (r.finished_time or now())).total_seconds() < 86400
            )
            and (not args.node or r.node == args.node)
        ]
        if not _print([msgspec.to_builtins(r) for r in rems], args.output):
            rows = [
                [
                    r.id,
                    r.action.value,
                    r.state.value,
                    r.requester.name,
                    r.approver.name if r.approver else "-",
                    _age(r.created_time),
                    _short(r.reason, 60),
                ]
                for r in rems
            ]
            print(table(["ID", "ACTION", "STATE", "REQUESTER", "APPROVER", "AGE", "REASON"], rows))
        return 0
    finally:
        await bus.close()


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


def _time(when: datetime | None) -> str:
    return f"{when:%Y-%m-%dT%H:%M:%SZ}" if when else "-"


async def _describe(args: argparse.Namespace) -> int:
    from app.output import table

    bus = await _open(args)
    try:
        if args.kind == "alert":
            found_alert = await bus.bucket(names.BUCKET_ALERTS, Alert).get(args.name)
            if found_alert is None:
                raise NodusError(ErrorCode.NOT_FOUND, f"alert {args.name} not found")
            a = found_alert.value
            lines = [
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
            print("\n".join(lines))
            return 0
        rems = bus.bucket(names.BUCKET_REMEDIATIONS, Remediation)
        found = await rems.get(args.name)
        if found is None:
            rec = await bus.bucket(names.BUCKET_RECOMMENDATIONS, Recommendation).get(args.name)
            if rec is not None and rec.value.remediation_id:
                found = await rems.get(rec.value.remediation_id)
        if found is None:
            raise NodusError(ErrorCode.NOT_FOUND, f"remediation {args.name} not found")
        r = found.value
        requester = r.requester.name + (
            f" (detector {r.requester.detector}, request {r.requester.request_id})"
            if r.requester.kind == "external"
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
        lines.extend(
            "  " + line
            for line in table(
                ["TIME", "STATE", "BY", "REASON"],
                [[_time(h.time), h.state.value, h.by, _short(h.reason, 80)] for h in r.history],
            ).splitlines()
        )
        print("\n".join(lines))
        return 0
    finally:
        await bus.close()


# -- approve, cancel, breaker, repair --------------------------------------------------------------


async def _request(
    args: argparse.Namespace, subject: str, body: msgspec.Struct, reply: type[Any]
) -> Any:
    bus = await Bus.open(args.nats, name="nodus-client", credentials=args.credentials)
    try:
        return await bus.request(subject, body, reply, timeout=10.0)
    finally:
        await bus.close()


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


async def _cancel(args: argparse.Namespace) -> int:
    reply: RemediationReply = await _request(
        args,
        names.API_REMEDIATION_CANCEL,
        CancelRequest(id=args.id, by=args.who, reason=args.reason),
        RemediationReply,
    )
    print(f"remediation/{reply.remediation.id} {reply.remediation.state.value}")
    return 0


async def _breaker(args: argparse.Namespace) -> int:
    if args.breaker_command == "reset":
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
    from app.output import table

    bus = await _open(args)
    try:
        found = await bus.bucket(names.BUCKET_BREAKERS, Breaker).snapshot()
    finally:
        await bus.close()
    breakers = [b.value for b in found.values()]
    if not _print([msgspec.to_builtins(b) for b in breakers], args.output):
        rows = [
            [
                b.cluster,
                "Open" if b.open else "Closed",
                str(b.trips),
                str(len(b.held)),
                _short(b.opened_reason or (f"reset by {b.reset_by}" if b.reset_by else ""), 70),
            ]
            for b in breakers
        ]
        print(table(["CLUSTER", "STATE", "TRIPS", "HELD", "REASON"], rows))
    return 0


async def _repair(args: argparse.Namespace) -> int:
    values = {}
    for item in args.value:
        name, _, number = item.partition("=")
        try:
            values[name] = float(number)
        except ValueError:
            raise NodusError(ErrorCode.INVALID, f"--value {item!r}: not NAME=NUMBER") from None
    evidence = [
        Evidence(
            kind=AlertKind.EXTERNAL,
            source=f"external:{args.detector}",
            node=args.node,
            where=args.where or args.detector,
            observed_time=now(),
            severity=args.severity,
            lines=args.line,
            values=values,
        )
    ]
    try:
        request = RepairRequest(
            detector=args.detector,
            request_id=args.request_id,
            node=args.node,
            action=args.action,
            evidence=evidence if (args.line or values) else [],
            reason=args.reason,
        )
        request = convert(msgspec.to_builtins(request), RepairRequest)
    except msgspec.ValidationError as error:
        raise NodusError(ErrorCode.INVALID, str(error)) from None
    reply: RemediationReply = await _request(
        args, names.API_REMEDIATION_REQUEST, request, RemediationReply
    )
    if _print(msgspec.to_builtins(reply.remediation), args.output):
        return 0
    r = reply.remediation
    print(
        f"remediation/{r.id} {'created' if reply.created else 'exists (same request)'}: "
        f"{r.action.value} of {r.node}, {r.state.value}"
    )
    return 0


# -- policy ------------------------------------------------------------------------------------------


def _consent(items: list[str]) -> dict[int, list[Action]]:
    result: dict[int, list[Action]] = {}
    for item in items:
        code, _, actions = item.partition("=")
        try:
            result[int(code)] = [parse_action(a) for a in actions.split(",") if a]
        except (ValueError, argparse.ArgumentTypeError) as error:
            raise NodusError(ErrorCode.INVALID, f"--xid {item!r}: {error}") from None
    return result


def updated_policy(current: Policy, args: argparse.Namespace) -> Policy:
    """The policy after `nodus policy set` flags; validated like any record."""
    if args.filename is not None:
        try:
            raw = yaml.safe_load(args.filename.read_text())
        except (OSError, yaml.YAMLError) as error:
            raise NodusError(ErrorCode.INVALID, f"{args.filename}: {error}") from None
        base: dict[str, Any] = raw if isinstance(raw, dict) else {}
    else:
        base = msgspec.to_builtins(current)
    if args.mode:
        base["mode"] = "Automatic" if args.mode == "automatic" else "ApproveBeforeRepair"
    if args.trust is not None:
        base["trustedActions"] = [parse_action(a).value for a in args.trust.split(",") if a]
    consent: dict[str, Any] = dict(base.get("xidConsent") or {})
    for code, actions in _consent(args.xid).items():
        entry = dict(consent.get(str(code)) or {})
        entry["auto"] = [a.value for a in actions]
        consent[str(code)] = entry
    for code, actions in _consent(args.xid_approve).items():
        entry = dict(consent.get(str(code)) or {})
        entry["approve"] = [a.value for a in actions]
        consent[str(code)] = entry
    base["xidConsent"] = consent
    idle = dict(base.get("idle") or {})
    if args.idle_max_wait is not None:
        idle["maxWaitSeconds"] = args.idle_max_wait
    if args.never_interrupt is not None:
        idle["neverInterrupt"] = args.never_interrupt
    base["idle"] = idle
    if args.approval_node is not None:
        base["approvalRequiredNodes"] = args.approval_node
    base["updatedBy"] = args.who
    base["updatedTime"] = now().isoformat()
    try:
        return convert(base, Policy)
    except msgspec.ValidationError as error:
        message = str(error)
        if "maxWaitSeconds" in message:
            message += " (the max wait for idle is capped at 24h; use --never-interrupt to wait "
            message += "without limit)"
        raise NodusError(ErrorCode.INVALID, f"policy: {message}") from None


async def _policy(args: argparse.Namespace) -> int:
    from services.remediator.policy import DEFAULT_KEY, policy_key

    key = policy_key(args.cluster) if args.cluster else DEFAULT_KEY
    bus = await _open(args)
    try:
        bucket = bus.bucket(names.BUCKET_REMEDIATION_POLICY, Policy)
        current = await bucket.get(key)
        if args.policy_command == "get":
            if current is None and key != DEFAULT_KEY:
                fallback = await bucket.get(DEFAULT_KEY)
                print(f"# cluster {args.cluster} has no policy of its own: the default applies")
                current = fallback
            shown = current.value if current else Policy()
            document = {
                "mode": shown.mode,
                "trustedActions": [a.value for a in shown.trusted_actions],
                "xidConsent": msgspec.to_builtins(shown.xid_consent),
                "idle": {
                    "maxWaitSeconds": shown.idle.max_wait_seconds,
                    "neverInterrupt": shown.idle.never_interrupt,
                },
                "approvalRequiredNodes": shown.approval_required_nodes,
                "updatedBy": shown.updated_by,
                "updatedTime": shown.updated_time.isoformat() if shown.updated_time else None,
            }
            _print(document, args.output if args.output in ("json", "yaml") else "yaml")
            return 0
        new = updated_policy(current.value if current else Policy(), args)

        def change(_: Policy | None) -> Policy:
            return new

        await bucket.mutate(key, change)
        print(f"policy/{key} updated: {_summary(new)}")
        return 0
    finally:
        await bus.close()


def _summary(policy: Policy) -> str:
    parts: list[str] = [policy.mode]
    if policy.mode == "Automatic":
        parts.append("trusted " + (",".join(a.value for a in policy.trusted_actions) or "none"))
    for code, consent in sorted(policy.xid_consent.items()):
        if consent.auto:
            parts.append(f"Xid {code} auto {','.join(a.value for a in consent.auto)}")
        if consent.approve:
            parts.append(f"Xid {code} person {','.join(a.value for a in consent.approve)}")
    idle = policy.idle
    parts.append(
        "never interrupt" if idle.never_interrupt else f"idle max wait {idle.max_wait_seconds:g}s"
    )
    return "; ".join(parts)


# -- faults ------------------------------------------------------------------------------------------


def _fault(args: argparse.Namespace) -> int:
    from services.remediator import faults

    directory = args.state_dir / "machines" / args.node
    if args.fault_command == "clear":
        faults.clear(directory, args.kind)
        print(f"{args.node}: {args.kind or 'every'} fault cleared")
        return 0
    written = faults.inject(
        directory,
        faults.Fault(kind=args.kind, gpu=args.gpu, xid=args.xid, port=args.port, count=args.count),
        sticky=args.sticky,
    )
    print(written)
    return 0

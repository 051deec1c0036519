"""`nodus policy get|set`: the automatic repair policy (R5, R6)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import msgspec
import yaml

from app.cli.common import Command, emit, group, output_flag, run_async
from app.cli.repair import open_bus, parse_action, parse_duration, repair_flags, who_flag
from libs.contracts import names
from libs.contracts.base import convert, now
from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.remediation import Action, Policy


def _consent(items: list[str]) -> dict[int, list[Action]]:
    result: dict[int, list[Action]] = {}
    for item in items:
        code, _, actions = item.partition("=")
        try:
            result[int(code)] = [parse_action(a) for a in actions.split(",") if a]
        except (ValueError, argparse.ArgumentTypeError) as error:
            raise NodusError(ErrorCode.INVALID, f"--xid {item!r}: {error}") from None
    return result


def _merge_consent(base: dict[str, Any], args: argparse.Namespace) -> None:
    consent: dict[str, Any] = dict(base.get("xidConsent") or {})
    for field, items in (("auto", args.xid), ("approve", args.xid_approve)):
        for code, actions in _consent(items).items():
            entry = dict(consent.get(str(code)) or {})
            entry[field] = [a.value for a in actions]
            consent[str(code)] = entry
    base["xidConsent"] = consent


def _merge_idle(base: dict[str, Any], args: argparse.Namespace) -> None:
    idle = dict(base.get("idle") or {})
    if args.idle_max_wait is not None:
        idle["maxWaitSeconds"] = args.idle_max_wait
    if args.never_interrupt is not None:
        idle["neverInterrupt"] = args.never_interrupt
    base["idle"] = idle


def _base(current: Policy, filename: Path | None) -> dict[str, Any]:
    """What `policy set` starts from: the file given, or the policy in force."""
    if filename is None:
        document: dict[str, Any] = msgspec.to_builtins(current)
        return document
    try:
        raw = yaml.safe_load(filename.read_text())
    except (OSError, yaml.YAMLError) as error:
        raise NodusError(ErrorCode.INVALID, f"{filename}: {error}") from None
    return raw if isinstance(raw, dict) else {}


def updated_policy(current: Policy, args: argparse.Namespace) -> Policy:
    """The policy after `nodus policy set` flags; validated like any record."""
    base = _base(current, args.filename)
    if args.mode:
        base["mode"] = "Automatic" if args.mode == "automatic" else "ApproveBeforeRepair"
    if args.trust is not None:
        base["trustedActions"] = [parse_action(a).value for a in args.trust.split(",") if a]
    _merge_consent(base, args)
    _merge_idle(base, args)
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


def summary(policy: Policy) -> str:
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


def _key(args: argparse.Namespace) -> str:
    from services.remediator.policy import DEFAULT_KEY, policy_key

    return policy_key(args.cluster) if args.cluster else DEFAULT_KEY


def _document(policy: Policy) -> dict[str, Any]:
    """What `policy get` shows: the policy's settings in the record's field names."""
    return {
        "mode": policy.mode,
        "trustedActions": [a.value for a in policy.trusted_actions],
        "xidConsent": msgspec.to_builtins(policy.xid_consent),
        "idle": {
            "maxWaitSeconds": policy.idle.max_wait_seconds,
            "neverInterrupt": policy.idle.never_interrupt,
        },
        "approvalRequiredNodes": policy.approval_required_nodes,
        "updatedBy": policy.updated_by,
        "updatedTime": policy.updated_time.isoformat() if policy.updated_time else None,
    }


def _get_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", help="a cluster's own policy (default: the default one)")
    output_flag(parser, "yaml|json", default="yaml")
    repair_flags(parser)


async def _get(args: argparse.Namespace) -> int:
    from services.remediator.policy import DEFAULT_KEY

    key = _key(args)
    async with open_bus(args) as bus:
        bucket = bus.bucket(names.BUCKET_REMEDIATION_POLICY, Policy)
        current = await bucket.get(key)
        if current is None and key != DEFAULT_KEY:
            print(f"# cluster {args.cluster} has no policy of its own: the default applies")
            current = await bucket.get(DEFAULT_KEY)
    shown = current.value if current else Policy()
    emit(_document(shown), args.output if args.output in ("json", "yaml") else "yaml")
    return 0


def _set_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", help="set a cluster's own policy")
    parser.add_argument("-f", "--filename", type=Path, help="the whole policy, YAML or JSON")
    parser.add_argument("--mode", choices=["approve", "automatic"])
    parser.add_argument("--trust", help="the trusted actions of automatic mode, comma-separated")
    parser.add_argument("--xid", action="append", default=[], metavar="CODE=ACTION[,ACTION]")
    parser.add_argument(
        "--xid-approve", action="append", default=[], metavar="CODE=ACTION[,ACTION]"
    )
    parser.add_argument("--idle-max-wait", type=parse_duration, help="e.g. 2h (cap 24h)")
    never = parser.add_mutually_exclusive_group()
    never.add_argument("--never-interrupt", action="store_true", default=None)
    never.add_argument("--interrupt", dest="never_interrupt", action="store_false")
    parser.add_argument(
        "--approval-node", action="append", default=None, help="a node that always needs a person"
    )
    who_flag(parser)
    repair_flags(parser)


async def _set(args: argparse.Namespace) -> int:
    key = _key(args)
    async with open_bus(args) as bus:
        bucket = bus.bucket(names.BUCKET_REMEDIATION_POLICY, Policy)
        current = await bucket.get(key)
        new = updated_policy(current.value if current else Policy(), args)

        def change(_: Policy | None) -> Policy:
            return new

        await bucket.mutate(key, change)
    print(f"policy/{key} updated: {summary(new)}")
    return 0


POLICY = group(
    "policy",
    "the automatic repair policy (R5, R6)",
    "policy_command",
    [
        Command("get", "show the policy", _get_flags, run_async(_get)),
        Command(
            "set",
            "change the policy",
            _set_flags,
            run_async(_set),
            description="Change the repair policy; flags not given keep their value. Approve-"
            "before-repair is the default; `--mode automatic --trust reboot,power-cycle` runs "
            "those actions without a person; `--xid 119=reboot` approves a reboot for Xid 119 in "
            "advance, `--xid-approve 95=migrate` always asks a person.",
        ),
    ],
)

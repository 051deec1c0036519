"""`nodus label node NAME KEY=VALUE ... KEY-`: a node's labels, and repairs asked through them
(R8). The caller is who the bus says the credentials are: a detector's user speaks only as
that detector; an operator's names itself with `--detector` (default: the user's name)."""

from __future__ import annotations

import argparse
import os

import msgspec

from app.cli.common import Command, emit, group, output_flag, run_async
from app.cli.repair import open_bus, repair_flags
from app.output import table
from libs.bus import Bus
from libs.bus.auth import DETECTOR_INBOX, detector_of
from libs.contracts import names
from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.remediation import LabelReply, LabelRequest, NodeLabels


def parse_changes(items: list[str]) -> tuple[dict[str, str], list[str]]:
    """kubectl's syntax: `KEY=VALUE` sets, `KEY-` removes."""
    changes: dict[str, str] = {}
    removals: list[str] = []
    for item in items:
        if "=" in item:
            key, _, value = item.partition("=")
            if key in changes and changes[key] != value:
                raise NodusError(ErrorCode.INVALID, f"{key} given twice: {item!r}")
            changes[key] = value
        elif item.endswith("-") and len(item) > 1:
            removals.append(item[:-1])
        else:
            raise NodusError(
                ErrorCode.INVALID, f"{item!r}: KEY=VALUE sets a label, KEY- removes one"
            )
    return changes, removals


def detector_named(confined: str | None, asked: str | None) -> str | None:
    """The detector a request speaks as: the one these credentials are (`confined`, from the
    server), or for an operator's the one asked for."""
    if confined is not None and asked and asked != confined:
        raise NodusError(
            ErrorCode.INVALID,
            f"these credentials are detector {confined}'s; they cannot speak as {asked}",
        )
    return confined or asked


async def caller_of(bus: Bus, asked: str | None) -> str:
    """Whom a label change names: the detector, else (operator credentials) the person."""
    detector = detector_named(detector_of(await bus.user_info()), asked)
    return detector or os.environ.get("NODUS_USER") or os.environ.get("USER") or "operator"


def _label_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("node")
    parser.add_argument("changes", nargs="*", metavar="KEY=VALUE|KEY-")
    parser.add_argument("--overwrite", action="store_true", help="change a label's value")
    parser.add_argument(
        "--detector",
        help="with an operator's credentials: the detector to speak as (a detector's own "
        "credentials name it)",
    )
    output_flag(parser, "json|yaml|jsonpath=... (default: the labels)")
    repair_flags(parser)


def _print_labels(labels: NodeLabels) -> None:
    rows = [
        [k, v.value, v.by, f"{v.time:%Y-%m-%dT%H:%M:%SZ}"] for k, v in sorted(labels.labels.items())
    ]
    print(
        table(["LABEL", "VALUE", "SET BY", "TIME"], rows) if rows else f"{labels.node}: no labels"
    )


async def _label(args: argparse.Namespace) -> int:
    changes, removals = parse_changes(args.changes)
    if not changes and not removals:
        async with open_bus(args, buckets=[names.BUCKET_NODE_LABELS]) as bus:
            found = await bus.bucket(names.BUCKET_NODE_LABELS, NodeLabels).get(args.node)
        labels = found.value if found else NodeLabels(node=args.node)
        if not emit(msgspec.to_builtins(labels), args.output):
            _print_labels(labels)
        return 0
    try:
        request = LabelRequest(
            node=args.node, set=changes, remove=removals, overwrite=args.overwrite
        )
        request = msgspec.convert(msgspec.to_builtins(request), LabelRequest)
    except msgspec.ValidationError as error:
        raise NodusError(ErrorCode.INVALID, str(error)) from None
    async with open_bus(args, buckets=None, inbox_prefix=DETECTOR_INBOX) as bus:
        caller = await caller_of(bus, args.detector)
        reply: LabelReply = await bus.request(
            names.caller_subject(names.API_NODE_LABEL, caller), request, LabelReply, timeout=10.0
        )
    if emit(msgspec.to_builtins(reply), args.output):
        return 0
    print(f"node/{args.node} labeled by {caller}")
    if reply.remediation is not None:
        r = reply.remediation
        print(
            f"remediation/{r.id} {'created' if reply.created else 'exists (same request)'}: "
            f"{r.action.value} of {r.node}, {r.state.value}, requested by {r.requester.name}"
        )
    return 0


LABEL = group(
    "label",
    "a node's labels; repair.nodus.io/action and request-id ask for a repair (R8)",
    "label_command",
    [
        Command(
            "node",
            "set (KEY=VALUE) and remove (KEY-) a node's labels, or list them",
            _label_flags,
            run_async(_label),
            description="Set and remove labels on a node. repair.nodus.io/action=reboot|"
            "reprovision|migrate with repair.nodus.io/request-id=ID and "
            "repair.nodus.io/evidence=LINE asks for a repair as the detector the credentials "
            "name: idempotent on (detector, request id), never delete; the reply names the "
            "remediation, and the node keeps it as repair.nodus.io/remediation.",
        )
    ],
)

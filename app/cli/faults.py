"""`nodus fault inject NODE KIND [...]` and `nodus fault clear NODE [KIND]`: the lab's faults,
written into a local machine's files in their real formats (demos, tests of the monitor)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from app.cli.common import Command, group
from app.lab import faults

# -- faults --------------------------------------------------------------------------------------


def _state_dir_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=Path(os.environ.get("NODUS_STATE_DIR", ".nodus")),
        help="`nodus up`'s state dir: machine files under STATE_DIR/machines/NAME (default .nodus)",
    )


def _fault_inject_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("node")
    parser.add_argument("kind", choices=faults.KINDS)
    parser.add_argument("--xid", type=int, default=79)
    parser.add_argument("--gpu", type=int, default=0, help="GPU index")
    parser.add_argument("--port", default="mlx5_0/1", help="InfiniBand device/port")
    parser.add_argument("--count", type=int, default=1, help="ECC errors, or link flaps")
    parser.add_argument(
        "--sticky", action="store_true", help="hardware: survives reboots and reprovisions"
    )
    _state_dir_flag(parser)


def _fault_inject(args: argparse.Namespace) -> int:
    fault = faults.Fault(
        kind=args.kind, gpu=args.gpu, xid=args.xid, port=args.port, count=args.count
    )
    print(faults.inject(args.state_dir / "machines" / args.node, fault, sticky=args.sticky))
    return 0


def _fault_clear_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("node")
    parser.add_argument("kind", nargs="?", choices=faults.KINDS)
    _state_dir_flag(parser)


def _fault_clear(args: argparse.Namespace) -> int:
    faults.clear(args.state_dir / "machines" / args.node, args.kind)
    print(f"{args.node}: {args.kind or 'every'} fault cleared")
    return 0


FAULT = group(
    "fault",
    "write a fault into a local machine's files (demos)",
    "fault_command",
    [
        Command(
            "inject",
            "write a fault in its real format",
            _fault_inject_flags,
            _fault_inject,
            description="Write a fault the way the kernel, dcgm-exporter, Node Problem Detector "
            "or sysfs write it, into STATE_DIR/machines/NODE/. Kinds: "
            + ", ".join(faults.KINDS)
            + ".",
        ),
        Command("clear", "undo injected faults", _fault_clear_flags, _fault_clear),
    ],
)

"""`nodus agent`: one per machine."""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
from pathlib import Path

from libs.bus import Bus
from libs.bus.auth import AGENT_BUCKETS, agent_inbox
from libs.contracts import names
from libs.contracts.bounds import (
    HEARTBEAT_TIMEOUT_SECONDS,
    HEARTBEATS_PER_TIMEOUT,
    TUNNEL_BUFFER_LIMIT_BYTES,
)
from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.fleet import Machine, load_fleet
from libs.discovery.gpus import DiscoveryError
from libs.runtime import add_common_flags, run_daemon
from libs.runtime.service import RestartProcess
from services.agent.agent import Agent
from services.agent.dataplane.supervisor import Launch, log_dir_beside_stderr
from services.agent.direct.wireguard import BINARY_ENV, MODE_ENV, MODES
from services.agent.discover import MACHINE_FILE, discover, load_facts
from services.agent.hostpower import DEFAULT_COMMAND as DEFAULT_REBOOT_COMMAND
from services.agent.inventory import Described


def _machine(args: argparse.Namespace) -> Machine | Described:
    if args.fleet is not None:
        fleet = load_fleet(args.fleet)
        machine = next((m for m in fleet.machines if m.name == args.node), None)
        if machine is None:
            raise NodusError(ErrorCode.NOT_FOUND, f"machine {args.node} is not in {args.fleet}")
        return machine
    overrides = {
        "provider": args.provider,
        "region": args.region,
        "regionClass": args.region_class,
        "pool": args.pool,
        "cluster": args.cluster,
        "interface": args.interface,
        "privateNetwork": args.private_network,
        "privateInterface": args.private_interface,
    }
    try:
        facts = load_facts(args.machine_file, overrides)
        return Described(*discover(args.node, facts))
    except (DiscoveryError, NodusError) as error:
        raise NodusError(ErrorCode.INVALID, f"this machine cannot be described: {error}") from None


def build_parser(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "The per-machine agent: registers this machine's inventory, version and capabilities, "
        "heartbeats, answers requests addressed to its node, and joins the gang epochs its "
        "join keys name."
    )
    add_common_flags(parser, metrics_port=0)
    parser.add_argument("--node", required=True, help="this machine's name")
    fleet = os.environ.get("NODUS_FLEET")
    parser.add_argument(
        "--fleet",
        type=Path,
        default=Path(fleet) if fleet else None,
        help="the lab only: a fleet file that describes this machine (env NODUS_FLEET); "
        "without one the agent describes its own machine (O1)",
    )
    facts = parser.add_argument_group(
        "what the platform must be told of this machine (without --fleet; each also a key of "
        f"{MACHINE_FILE}, the flag winning)"
    )
    facts.add_argument("--provider")
    facts.add_argument("--region")
    facts.add_argument("--region-class", help="default: the region")
    facts.add_argument("--pool")
    facts.add_argument("--cluster")
    facts.add_argument("--interface", help="the underlay interface; default: the default route's")
    facts.add_argument("--private-network", help="the provider's private network it is on")
    facts.add_argument("--private-interface", help="the private network's interface")
    facts.add_argument(
        "--machine-file", type=Path, default=MACHINE_FILE, help="the machine facts file"
    )
    parser.add_argument(
        "--heartbeat-seconds",
        type=float,
        default=HEARTBEAT_TIMEOUT_SECONDS / HEARTBEATS_PER_TIMEOUT,
        help="seconds between heartbeats; the placer calls a node lost after "
        f"{HEARTBEAT_TIMEOUT_SECONDS:g} s without one",
    )
    parser.add_argument(
        "--socks-listen",
        default=names.SOCKS_ENDPOINT,
        help="where this agent serves SOCKS5 to the shim",
    )
    parser.add_argument(
        "--tunnel-buffer-mib",
        type=int,
        default=TUNNEL_BUFFER_LIMIT_BYTES >> 20,
        help="memory one Relayed member's tunnel may buffer; plans needing more are refused (C3)",
    )
    parser.add_argument(
        "--nodus0",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on a VM, create the nodus0 WireGuard device for Direct gangs (needs root and a "
        "network namespace of this machine's own; `nodus up` without --netns turns it off)",
    )
    parser.add_argument(
        "--wireguard",
        choices=MODES,
        default=os.environ.get(MODE_ENV, "auto"),
        help="which WireGuard runs nodus0: `auto` (the kernel's where it creates a WireGuard "
        "device, else wireguard-go), `kernel` (fail without the module) or `userspace` "
        f"(wireguard-go); default ${MODE_ENV} or auto",
    )
    parser.add_argument(
        "--wireguard-go",
        default=os.environ.get(BINARY_ENV),
        metavar="PATH",
        help=f"the wireguard-go to run (default ${BINARY_ENV}, else the one on PATH)",
    )
    parser.add_argument(
        "--port-rules",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="on a private network, open the rendezvous and NCCL ports to the gang's members "
        "only while it runs (nftables; needs root and a network namespace of this machine's "
        "own; `nodus up` without --netns turns it off)",
    )
    parser.add_argument(
        "--state-dir", type=Path, help="this machine's files (STATE_DIR/machines/NAME)"
    )
    parser.add_argument(
        "--dataplane-processes",
        action=argparse.BooleanOptionalAction,
        default=os.environ.get("NODUS_DATAPLANE_PROCESSES", "1") != "0",
        help="run each Relayed and Direct epoch's dataplane in a process of its own, which an "
        "agent restart (an upgrade, a crash) leaves running and the next agent re-adopts "
        "(env NODUS_DATAPLANE_PROCESSES=0 turns it off: the dataplanes then end with the "
        "agent, as before; for comparisons)",
    )
    parser.add_argument(
        "--host-reboot",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="let the remediator reboot this host in-band (R18): the agent drains its ranks, "
        "then runs --reboot-command. Off by default; needs the right to reboot (root, or a "
        "polkit rule for org.freedesktop.login1.reboot)",
    )
    parser.add_argument(
        "--reboot-command",
        type=shlex.split,
        default=list(DEFAULT_REBOOT_COMMAND),
        help="how --host-reboot reboots this host (default: systemctl reboot)",
    )


async def _body(args: argparse.Namespace, stop: asyncio.Event) -> None:
    # Through the environment: every nodus0 this agent's processes make chooses the same way.
    os.environ[MODE_ENV] = args.wireguard
    if args.wireguard_go:
        os.environ[BINARY_ENV] = args.wireguard_go
    machine = _machine(args)
    if args.state_dir:
        args.state_dir.mkdir(parents=True, exist_ok=True)
    bus = await Bus.open(
        args.nats,
        name=f"nodus-agent-{args.node}",
        credentials=args.credentials,
        buckets=AGENT_BUCKETS,
        inbox_prefix=agent_inbox(args.node),  # the only inbox its bus user may read (S1)
        confined=True,
    )
    rebooting = asyncio.Event()

    def reboot() -> None:  # the lab's machine provider reboots this machine
        rebooting.set()
        stop.set()

    agent = Agent(
        bus,
        machine,
        args.heartbeat_seconds,
        args.socks_listen,
        args.tunnel_buffer_mib << 20,
        state_dir=args.state_dir,
        nodus0=args.nodus0,
        port_rules=args.port_rules,
        restart=reboot,
        # Each epoch's dataplane in a process of its own, on the bus as this agent's user,
        # logging beside this agent's log (O4).
        dataplanes=(
            Launch(args.nats, args.credentials, log_dir_beside_stderr())
            if args.dataplane_processes
            else None
        ),
        host_reboot=args.host_reboot,
        reboot_command=args.reboot_command,
    )
    try:
        await agent.start()
        await stop.wait()
    finally:
        # The daemon stops, the machine does not (an upgrade, a crash, the lab's reboot, whose
        # new agent ends what the old boot ran): ranks, dataplanes and port rules stay.
        await agent.stop(keep_workloads=True)
        await bus.close()
    if rebooting.is_set():
        raise RestartProcess("the machine reboots: a new boot id, its ranks and tunnels gone")


def run(args: argparse.Namespace) -> int:
    return run_daemon("agent", args, _body)

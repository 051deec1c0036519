"""`nodus`: the command line. Client commands talk to the bus; daemon commands run a service."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable, Coroutine
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec

from libs.bus.connection import DEFAULT_URL
from libs.contracts.errors import NodusError

CommandBody = Callable[[argparse.Namespace], Coroutine[Any, Any, int]]


def _client_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nats",
        default=os.environ.get("NODUS_NATS_URL", DEFAULT_URL),
        help=f"bus URL (env NODUS_NATS_URL; default {DEFAULT_URL})",
    )
    parser.add_argument("--credentials", default=os.environ.get("NODUS_NATS_CREDS"))
    parser.add_argument("--org", help="the job's org, needed only when two orgs use one name")


def _output_flag(
    parser: argparse.ArgumentParser, formats: str = "wide|json|yaml|jsonpath=..."
) -> None:
    parser.add_argument("-o", "--output", default="", help=f"output format: {formats}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nodus",
        description="Nodus places distributed GPU jobs as gangs, joins their members into a "
        "private network per epoch, and hands every rank its environment.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser("up", help="run the whole system on this machine until Ctrl-C")
    up.add_argument("--fleet", type=Path, help="fleet file (default: examples/fleet.yaml)")
    up.add_argument("--nats-port", type=int, default=4222, help="NATS port (default 4222)")
    up.add_argument("--state-dir", type=Path, default=Path(".nodus"), help="default .nodus")
    up.add_argument("--placers", type=int, default=1, help="placer replicas (default 1)")

    demo = sub.add_parser("demo", help="the main job end to end on the embedded fleet, then exit")
    demo.add_argument(
        "--state-dir",
        type=Path,
        help="keep the system's files (logs/ included) here; default: a temporary directory",
    )

    apply = sub.add_parser("apply", help="submit jobs from a YAML file")
    apply.add_argument("-f", "--filename", type=Path, required=True)
    _client_flags(apply)

    get = sub.add_parser("get", help="list jobs or nodes, or show one job")
    get.add_argument("kind", choices=["jobs", "job", "nodes", "node", "ranktables"])
    get.add_argument("name", nargs="?")
    get.add_argument("-w", "--watch", action="store_true", help="keep printing changes (job)")
    _output_flag(get)
    _client_flags(get)

    describe = sub.add_parser(
        "describe", help="a job in full: members, plan bounds, conditions, events"
    )
    describe.add_argument("kind", choices=["job"])
    describe.add_argument("name")
    _client_flags(describe)

    env = sub.add_parser("env", help="a rank's environment as KEY=value lines")
    env.add_argument("name")
    env.add_argument("--rank", type=int, required=True)
    _output_flag(env, "json")
    _client_flags(env)

    logs = sub.add_parser("logs", help="a rank's output")
    logs.add_argument("name")
    logs.add_argument("--rank", type=int, required=True)
    logs.add_argument(
        "-f", "--follow", action="store_true", help="keep printing until the rank ends"
    )
    _client_flags(logs)

    delete = sub.add_parser("delete", help="delete a job: fence its epoch and free its machines")
    delete.add_argument("kind", choices=["job"])
    delete.add_argument("name")
    _client_flags(delete)

    usage = sub.add_parser("usage", help="billable usage per job: mesh-relay GiB")
    _output_flag(usage, "json")
    _client_flags(usage)

    schema = sub.add_parser("schema", help="JSON Schemas of every record and message")
    schema.add_argument("name", nargs="?", help="one schema (Job, Fleet, Epoch, ...)")

    from services.agent.main import build_parser as agent_parser
    from services.placer.main import build_parser as placer_parser
    from services.prober.main import build_parser as prober_parser
    from services.relay.main import build_parser as relay_parser

    placer_parser(sub.add_parser("placer", help="daemon: admission and placement"))
    agent_parser(sub.add_parser("agent", help="daemon: the per-machine agent"))
    relay_parser(sub.add_parser("relay", help="daemon: a relay for Relayed gangs"))
    prober_parser(sub.add_parser("prober", help="daemon: probes, qualification, the gang's run"))
    from app import remediation_cli

    remediation_cli.register(sub)  # node repair: get alerts, approve, policy, fault, ... (issue 6)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from app import remediation_cli

    if (code := remediation_cli.dispatch(args)) is not None:
        return code
    if args.command == "placer":
        from services.placer.main import run as run_placer

        return run_placer(args)
    if args.command == "agent":
        from services.agent.main import run as run_agent

        return run_agent(args)
    if args.command == "prober":
        from services.prober.main import run as run_prober

        return run_prober(args)
    if args.command == "relay":
        from services.relay.main import run as run_relay

        return run_relay(args)
    if args.command == "schema":
        return _schema(args)
    commands: dict[str, CommandBody] = {
        "apply": _apply,
        "get": _get,
        "describe": _describe,
        "env": _env,
        "delete": _delete,
        "usage": _usage,
        "logs": _logs,
        "up": _up,
        "demo": _demo,
    }
    try:
        return asyncio.run(commands[args.command](args))
    except NodusError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


# -- client commands ---------------------------------------------------------------------------


async def _with_client(args: argparse.Namespace, body: Callable[[Any], Awaitable[int]]) -> int:
    from libs.client.client import Client

    client = await Client.connect(args.nats, args.credentials)
    try:
        return await body(client)
    finally:
        await client.close()


async def _apply(args: argparse.Namespace) -> int:
    from libs.client.client import load_jobs

    jobs = load_jobs(args.filename)

    async def body(client: Any) -> int:
        failed = 0
        for job in jobs:
            try:
                reply = await client.apply(job)
            except NodusError as error:
                failed += 1
                print(f"job/{job.metadata.name} refused: {error}", file=sys.stderr)
                continue
            print(f"job/{job.metadata.name} {'created' if reply.created else 'unchanged'}")
        return 1 if failed else 0

    return await _with_client(args, body)


def _age(when: datetime | None) -> str:
    if when is None:
        return "-"
    seconds = int((datetime.now(UTC) - when).total_seconds())
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h"


JOB_COLUMNS = ["NAME", "ORG", "PHASE", "EPOCH", "TRANSPORT", "MEMBERS", "NODES", "REASON", "AGE"]


def _job_row(job: Any) -> list[str]:
    from libs.contracts.jobs import ConditionType

    gang = job.status.gang
    ready = job.condition(ConditionType.GANG_READY)
    return [
        job.metadata.name,
        job.metadata.org,
        job.status.phase.value,
        str(job.status.epoch),
        gang.transport.value if gang else "-",
        str(job.spec.distributed.members),
        ",".join(m.node for m in gang.members) if gang else "-",
        (ready.reason if ready and ready.status != "True" else "") or "-",
        _age(job.status.created_time),
    ]


async def _get(args: argparse.Namespace) -> int:
    from app.output import jsonpath, table, to_json, to_yaml
    from libs.client.client import job_document

    def render_one(document: Any) -> str:
        output = args.output
        if output.startswith("jsonpath="):
            return jsonpath(output.removeprefix("jsonpath=").strip("'\""), document)
        if output == "yaml":
            return to_yaml(document)
        return to_json(document)

    async def body(client: Any) -> int:
        if args.kind == "jobs":
            jobs = await client.list_jobs()
            if args.output in ("json", "yaml") or args.output.startswith("jsonpath="):
                print(render_one([job_document(j) for j in jobs]))
            else:
                print(table(JOB_COLUMNS, [_job_row(j) for j in jobs]))
            return 0
        if args.kind == "job":
            if args.watch:
                async for job in client.watch_job(args.name, args.org):
                    print(
                        render_one(job_document(job)) if args.output else "   ".join(_job_row(job)),
                        flush=True,
                    )
                return 0
            job = await client.get_job(args.name, args.org)
            if args.output:
                print(render_one(job_document(job)))
            else:
                print(table(JOB_COLUMNS, [_job_row(job)]))
            return 0
        if args.kind in ("nodes", "node"):
            nodes = await client.list_nodes()
            if args.kind == "node":
                nodes = [n for n in nodes if n[0].inventory.node == args.name]
                if not nodes:
                    print(f"error: node {args.name} not found", file=sys.stderr)
                    return 1
            if args.output:
                documents = [
                    {
                        **msgspec.to_builtins(r),
                        "health": msgspec.to_builtins(h) if h else None,
                        "gang": g,
                    }
                    for r, h, g in nodes
                ]
                print(render_one(documents if args.kind == "nodes" else documents[0]))
                return 0
            rows = []
            for record, health, gang in nodes:
                inv = record.inventory
                ready = (
                    health is not None
                    and health.healthy
                    and (datetime.now(UTC) - health.heartbeat_time).total_seconds() < 15
                )
                rows.append(
                    [
                        inv.node,
                        inv.provider,
                        inv.region,
                        inv.region_class,
                        inv.offering,
                        f"{inv.accelerators.count}x {inv.accelerators.model} ({inv.accelerators.backend})",
                        inv.address,
                        "Ready" if ready else "NotReady",
                        gang or "-",
                    ]
                )
            print(
                table(
                    [
                        "NAME",
                        "PROVIDER",
                        "REGION",
                        "CLASS",
                        "OFFERING",
                        "ACCELERATORS",
                        "ADDRESS",
                        "STATUS",
                        "GANG",
                    ],
                    rows,
                )
            )
            return 0
        ranktables = await client.global_ranktable()
        documents = [
            {**msgspec.to_builtins(item.value), "revision": item.revision}
            for item in sorted(ranktables.values(), key=lambda item: item.revision)
        ]
        print(render_one(documents) if args.output else to_yaml(documents))
        return 0

    if args.kind in ("job", "node") and not args.name:
        print(f"error: `nodus get {args.kind}` needs a NAME", file=sys.stderr)
        return 2
    return await _with_client(args, body)


async def _describe(args: argparse.Namespace) -> int:
    from app.output import table

    async def body(client: Any) -> int:
        job = await client.get_job(args.name, args.org)
        spec, status = job.spec, job.status
        acc = spec.accelerators
        lines = [
            f"Name:          {job.metadata.name}",
            f"Org:           {job.metadata.org}",
            f"Phase:         {status.phase.value}",
            f"Epoch:         {status.epoch}",
            f"Command:       {' '.join(spec.command)}",
            f"Distributed:   {spec.distributed.members} members, network {spec.distributed.network}, "
            f"transport {spec.distributed.transport}",
            f"Accelerators:  {acc.count}x {acc.model or 'any model'} ({acc.backend or 'any backend'})",
        ]
        if status.gang:
            lines.append(f"Path:          {status.gang.transport.value}")
            if status.gang.estimate:
                estimate = status.gang.estimate
                lines.append(
                    f"Estimate:      {estimate.relative_to_direct:g}x Direct throughput (assumed)"
                )
                if estimate.warning:
                    lines.append(f"Warning:       {estimate.warning}")
            if status.gang.probe:
                probe = status.gang.probe
                lines.append(
                    f"Probe:         slowest pair {probe.tcp_gbps:g} Gbit/s, {probe.rtt_ms:g} ms RTT, "
                    f"path {probe.path}"
                )
        if status.epoch:
            try:
                epoch = await client.epoch(job)
            except NodusError:
                epoch = None
            if epoch is not None:
                b = epoch.bounds
                lines.append("Members:")
                lines.extend(
                    "  " + line
                    for line in table(
                        ["RANK", "NODE", "ADDRESS", "INTERFACE", "DEVICES"],
                        [
                            [str(m.rank), m.node, m.address, m.interface, ",".join(m.devices)]
                            for m in epoch.members
                        ],
                    ).splitlines()
                )
                lines.append(
                    f"Epoch:         mesh {epoch.mesh_id[:12]}, join keys expire "
                    f"{epoch.join_keys_expire_time:%Y-%m-%dT%H:%M:%SZ}{', FENCED' if epoch.fenced else ''}"
                )
                if b.relay_gang_bits_per_second:
                    lines.append(
                        f"Bounds:        relay {b.relay_gang_bits_per_second / 1e9:g} Gbit/s per gang, "
                        f"{b.relay_member_bits_per_second / 1e6:g} Mbit/s per member, "
                        f"tunnel buffer {b.tunnel_buffer_bytes // 1024} KiB"
                    )
                lines.append(
                    f"Probe plan:    readiness within {b.probe_readiness_seconds:g}s, "
                    f"{b.probe_sample_seconds:g}s throughput sample per pair"
                )
        record = await client.probe(job) if status.epoch else None
        if record is not None:
            lines.append(
                f"Probe:         {record.state}, {len(record.pairs)} pairs in {record.rounds} rounds"
                + (f": {record.reason}" if record.reason else "")
            )
            lines.extend(
                "  " + line
                for line in table(
                    ["PAIR", "OK", "TCP GBIT/S", "RTT MS", "PATH", "CONNECTIONS", "ERROR"],
                    [
                        [
                            f"{p.a}-{p.b}",
                            "yes" if p.ok else "no",
                            f"{p.tcp_gbps:g}",
                            f"{p.rtt_ms:g}",
                            p.path or "-",
                            str(p.connections),
                            p.error or "",
                        ]
                        for p in record.pairs
                    ],
                ).splitlines()
            )
        if status.billing:
            b = status.billing
            lines.append(
                f"Billing:       boot {b.boot_seconds:g}s, run {b.run_seconds:g}s, mesh-relay {b.mesh_relay_gi_b:.6f} GiB"
            )
        lines.append("Conditions:")
        lines.extend(
            "  " + line
            for line in table(
                ["TYPE", "STATUS", "REASON", "MESSAGE"],
                [[c.type.value, c.status, c.reason, c.message] for c in status.conditions],
            ).splitlines()
        )
        events = await client.events(job)
        if events:
            lines.append("Events:")
            lines.extend(
                f"  {e.time:%H:%M:%S}  epoch {e.epoch}  {e.kind:<14} {e.message}" for e in events
            )
        print("\n".join(lines))
        return 0

    return await _with_client(args, body)


async def _env(args: argparse.Namespace) -> int:
    async def body(client: Any) -> int:
        env = await client.rank_env(args.name, args.rank, args.org)
        if args.output == "json":
            print(json.dumps(env, indent=2, sort_keys=True))
        else:
            for key in sorted(env):
                print(f"{key}={env[key]}")
        return 0

    return await _with_client(args, body)


async def _logs(args: argparse.Namespace) -> int:
    async def body(client: Any) -> int:
        offset = 0
        while True:
            reply = await client.logs(args.name, args.rank, offset, args.org)
            if reply.data:
                sys.stdout.write(reply.data)
                sys.stdout.flush()
            offset = reply.offset
            if not args.follow or (reply.state != "Running" and not reply.data):
                return 0
            if not reply.data:
                await asyncio.sleep(0.5)

    return await _with_client(args, body)


async def _delete(args: argparse.Namespace) -> int:
    async def body(client: Any) -> int:
        await client.delete(args.name, args.org)
        print(f"job/{args.name} deleted")
        return 0

    return await _with_client(args, body)


async def _usage(args: argparse.Namespace) -> int:
    from app.output import table

    async def body(client: Any) -> int:
        totals = await client.usage()
        rows = []
        for gang in sorted(totals):
            org, _, name = gang.partition(".")
            rows.append(
                {"job": name, "org": org, "line": "mesh-relay", "gib": totals[gang] / 2**30}
            )
        if args.output == "json":
            print(json.dumps(rows, indent=2))
        else:
            print(
                table(
                    ["JOB", "ORG", "LINE", "GIB"],
                    [[r["job"], r["org"], r["line"], f"{r['gib']:.6f}"] for r in rows],
                )
            )
        return 0

    return await _with_client(args, body)


def _schema(args: argparse.Namespace) -> int:
    import libs.contracts as contracts
    from libs.contracts.base import Record

    kinds = {
        name: kind
        for name in contracts.__all__
        if isinstance(kind := getattr(contracts, name), type) and issubclass(kind, Record)
    }
    if args.name:
        if args.name not in kinds:
            print(
                f"error: no schema {args.name!r}; one of {', '.join(sorted(kinds))}",
                file=sys.stderr,
            )
            return 2
        print(json.dumps(msgspec.json.schema(kinds[args.name]), indent=2))
        return 0
    _, components = msgspec.json.schema_components(list(kinds.values()))
    print(json.dumps(components, indent=2))
    return 0


# -- the whole system --------------------------------------------------------------------------


async def _up(args: argparse.Namespace) -> int:
    import signal

    from app.local import DEFAULT_FLEET, LocalSystem

    system = LocalSystem(
        fleet_path=args.fleet or DEFAULT_FLEET,
        state_dir=args.state_dir,
        nats_port=args.nats_port,
        placers=args.placers,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await system.start()
        assert system.fleet is not None
        print(f"NODUS_NATS_URL={system.url}", flush=True)
        print(
            f"# {len(system.fleet.machines)} machines, {args.placers} placer(s); "
            f"logs in {args.state_dir / 'logs'}; Ctrl-C stops everything",
            file=sys.stderr,
            flush=True,
        )
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=1.0)
            except TimeoutError:
                for name, code in system.restart_exited_relays():
                    print(f"# {name} exited ({code}); started it again", file=sys.stderr)
                system._check_children()
    finally:
        system.stop()
    return 0


async def _demo(args: argparse.Namespace) -> int:
    from app.demo import run_demo

    return await run_demo(args.state_dir)

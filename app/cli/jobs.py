"""`nodus` commands for jobs: apply, get jobs|job|nodes|node|ranktables, describe job, env, logs,
delete, usage."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec

from app.cli.common import (
    Command,
    Kind,
    age,
    client_flags,
    emit,
    indented,
    needs_name,
    output_flag,
    render,
    run_async,
)
from app.output import table, to_json, to_yaml
from libs.client.client import Client, job_document, load_jobs
from libs.contracts.epochs import Epoch
from libs.contracts.errors import NodusError
from libs.contracts.fleet import NodeHealth, NodeRecord
from libs.contracts.jobs import ConditionType, Job
from libs.contracts.lifecycle import ProbeRecord


@asynccontextmanager
async def _client(args: argparse.Namespace) -> AsyncIterator[Client]:
    client = await Client.connect(args.nats, args.credentials)
    try:
        yield client
    finally:
        await client.close()


# -- apply ---------------------------------------------------------------------------------------


def _apply_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-f", "--filename", type=Path, required=True)
    client_flags(parser)


async def _apply(args: argparse.Namespace) -> int:
    jobs = load_jobs(args.filename)
    failed = 0
    async with _client(args) as client:
        for job in jobs:
            try:
                reply = await client.apply(job)
            except NodusError as error:
                failed += 1
                print(f"job/{job.metadata.name} refused: {error}", file=sys.stderr)
                continue
            print(f"job/{job.metadata.name} {'created' if reply.created else 'unchanged'}")
    return 1 if failed else 0


# -- get -----------------------------------------------------------------------------------------

JOB_COLUMNS = ["NAME", "ORG", "PHASE", "EPOCH", "TRANSPORT", "MEMBERS", "NODES", "REASON", "AGE"]
NODE_COLUMNS = [
    "NAME",
    "PROVIDER",
    "REGION",
    "CLASS",
    "OFFERING",
    "ACCELERATORS",
    "ADDRESS",
    "STATUS",
    "GANG",
]
NodeView = tuple[NodeRecord, NodeHealth | None, str | None]


def _job_row(job: Job) -> list[str]:
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
        age(job.status.created_time),
    ]


def _node_row(record: NodeRecord, health: NodeHealth | None, gang: str | None) -> list[str]:
    inv = record.inventory
    ready = (
        health is not None
        and health.healthy
        and (datetime.now(UTC) - health.heartbeat_time).total_seconds() < 15
    )
    return [
        inv.node,
        inv.provider,
        inv.region,
        inv.region_class,
        inv.offering,
        f"{inv.accelerators.count}x {inv.accelerators.model} ({inv.accelerators.backend})",
        inv.address,
        ("Ready" if ready else "NotReady") + (",Failing" if health and health.failing else ""),
        gang or "-",
    ]


def _node_document(record: NodeRecord, health: NodeHealth | None, gang: str | None) -> Any:
    return {
        **msgspec.to_builtins(record),
        "health": msgspec.to_builtins(health) if health else None,
        "gang": gang,
    }


async def _get_jobs(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        jobs = await client.list_jobs()
    if not emit([job_document(j) for j in jobs], args.output):
        print(table(JOB_COLUMNS, [_job_row(j) for j in jobs]))
    return 0


async def _get_job(args: argparse.Namespace) -> int:
    if needs_name(args):
        return 2
    async with _client(args) as client:
        if args.watch:
            async for job in client.watch_job(args.name, args.org):
                text = render(job_document(job), args.output)
                print("   ".join(_job_row(job)) if text is None else text, flush=True)
            return 0
        job = await client.get_job(args.name, args.org)
    if not emit(job_document(job), args.output):
        print(table(JOB_COLUMNS, [_job_row(job)]))
    return 0


async def _get_nodes(args: argparse.Namespace) -> int:
    one = args.kind == "node"
    if one and needs_name(args):
        return 2
    async with _client(args) as client:
        nodes: list[NodeView] = await client.list_nodes()
    if one:
        nodes = [n for n in nodes if n[0].inventory.node == args.name]
        if not nodes:
            print(f"error: node {args.name} not found", file=sys.stderr)
            return 1
    documents = [_node_document(*node) for node in nodes]
    if not emit(documents[0] if one else documents, args.output):
        print(table(NODE_COLUMNS, [_node_row(*node) for node in nodes]))
        # What an agent fails to converge to: said under the table, one line each.
        for record, health, _ in nodes:
            for line in health.failing if health else []:
                print(f"{record.inventory.node}: {line}")
    return 0


async def _get_ranktables(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        ranktables = await client.global_ranktable()
    documents = [
        {**msgspec.to_builtins(item.value), "revision": item.revision}
        for item in sorted(ranktables.values(), key=lambda item: item.revision)
    ]
    if not emit(documents, args.output):
        print(to_yaml(documents))
    return 0


GET_KINDS = [
    Kind("jobs", _get_jobs),
    Kind("job", _get_job),
    Kind("nodes", _get_nodes),
    Kind("node", _get_nodes),
    Kind("ranktables", _get_ranktables),
]

# -- describe job --------------------------------------------------------------------------------


def _spec_lines(job: Job) -> list[str]:
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
    gang = status.gang
    if gang:
        lines.append(f"Path:          {gang.transport.value}")
        if gang.estimate:
            estimate = gang.estimate
            lines.append(
                f"Estimate:      {estimate.relative_to_direct:g}x Direct throughput (assumed)"
            )
            if estimate.warning:
                lines.append(f"Warning:       {estimate.warning}")
        if gang.probe:
            probe = gang.probe
            lines.append(
                f"Probe:         slowest pair {probe.tcp_gbps:g} Gbit/s, {probe.rtt_ms:g} ms RTT, "
                f"path {probe.path}"
            )
    return lines


def _epoch_lines(epoch: Epoch) -> list[str]:
    b = epoch.bounds
    lines = ["Members:"]
    lines += indented(
        table(
            ["RANK", "NODE", "ADDRESS", "INTERFACE", "DEVICES"],
            [
                [str(m.rank), m.node, m.address, m.interface, ",".join(m.devices)]
                for m in epoch.members
            ],
        )
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
    return lines


def _probe_lines(record: ProbeRecord) -> list[str]:
    lines = [
        f"Probe:         {record.state}, {len(record.pairs)} pairs in {record.rounds} rounds"
        + (f": {record.reason}" if record.reason else "")
    ]
    lines += indented(
        table(
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
        )
    )
    return lines


def _status_lines(job: Job) -> list[str]:
    status = job.status
    lines = []
    if status.billing:
        b = status.billing
        lines.append(
            f"Billing:       boot {b.boot_seconds:g}s, run {b.run_seconds:g}s, mesh-relay {b.mesh_relay_gi_b:.6f} GiB"
        )
    lines.append("Conditions:")
    lines += indented(
        table(
            ["TYPE", "STATUS", "REASON", "MESSAGE"],
            [[c.type.value, c.status, c.reason, c.message] for c in status.conditions],
        )
    )
    return lines


async def _describe_job(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        job = await client.get_job(args.name, args.org)
        lines = _spec_lines(job)
        if job.status.epoch:
            try:
                epoch: Epoch | None = await client.epoch(job)
            except NodusError:
                epoch = None
            if epoch is not None:
                lines += _epoch_lines(epoch)
            if (record := await client.probe(job)) is not None:
                lines += _probe_lines(record)
        lines += _status_lines(job)
        if events := await client.events(job):
            lines.append("Events:")
            lines.extend(
                f"  {e.time:%H:%M:%S}  epoch {e.epoch}  {e.kind:<14} {e.message}" for e in events
            )
    print("\n".join(lines))
    return 0


DESCRIBE_KINDS = [Kind("job", _describe_job)]

# -- env, logs, delete, usage --------------------------------------------------------------------


def _rank_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name")
    parser.add_argument("--rank", type=int, required=True)


def _env_flags(parser: argparse.ArgumentParser) -> None:
    _rank_flags(parser)
    output_flag(parser, "json")
    client_flags(parser)


async def _env(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        env = await client.rank_env(args.name, args.rank, args.org)
    if args.output == "json":
        print(json.dumps(env, indent=2, sort_keys=True))
    else:
        for key in sorted(env):
            print(f"{key}={env[key]}")
    return 0


def _logs_flags(parser: argparse.ArgumentParser) -> None:
    _rank_flags(parser)
    parser.add_argument(
        "-f", "--follow", action="store_true", help="keep printing until the rank ends"
    )
    client_flags(parser)


async def _logs(args: argparse.Namespace) -> int:
    offset = 0
    async with _client(args) as client:
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


def _delete_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("kind", choices=["job"])
    parser.add_argument("name")
    client_flags(parser)


async def _delete(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        await client.delete(args.name, args.org)
    print(f"job/{args.name} deleted")
    return 0


def _usage_flags(parser: argparse.ArgumentParser) -> None:
    output_flag(parser, "json")
    client_flags(parser)


async def _usage(args: argparse.Namespace) -> int:
    async with _client(args) as client:
        totals = await client.usage()
    rows: list[dict[str, Any]] = []
    for gang in sorted(totals):
        org, _, name = gang.partition(".")
        rows.append({"job": name, "org": org, "line": "mesh-relay", "gib": totals[gang] / 2**30})
    if args.output == "json":
        print(to_json(rows))
    else:
        print(
            table(
                ["JOB", "ORG", "LINE", "GIB"],
                [[r["job"], r["org"], r["line"], f"{r['gib']:.6f}"] for r in rows],
            )
        )
    return 0


# `get` and `describe` come next in `nodus --help`: app.cli.parser makes them of every
# subject's kinds.
APPLY = Command("apply", "submit jobs from a YAML file", _apply_flags, run_async(_apply))
COMMANDS = [
    Command("env", "a rank's environment as KEY=value lines", _env_flags, run_async(_env)),
    Command("logs", "a rank's output", _logs_flags, run_async(_logs)),
    Command(
        "delete",
        "delete a job: fence its epoch and free its machines",
        _delete_flags,
        run_async(_delete),
    ),
    Command("usage", "billable usage per job: mesh-relay GiB", _usage_flags, run_async(_usage)),
]

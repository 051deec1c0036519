"""`nodus qualify` and `nodus get qualifications` (G21): only measured numbers.

`nodus qualify --path direct --offerings lambda/vm+crusoe/vm` runs a 2-member job in the org
`nodus-system`, placed on a pair of machines of those types on that path only (`spec.qualify`),
whose probe measures the pair and whose command is the example all-reduce; it records the
result (`tcpGbps`, `rttMs`, the all-reduce's bus bandwidth, when, which machines) in
`nodus-qualifications`, where the placer reads the pairs it may place that path on.
`nodus get qualifications` prints the recorded runs, and nothing else.

`--members N` (Relayed only, 2 to 8) measures a gang of N: the probe measures every pair, the
all-reduce runs on every rank, and the slowest pair is recorded. The placer then admits
Relayed gangs of up to N members on those offerings (issue 26).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
import time
from typing import Any

import msgspec

from app.cli.common import Command, Kind, age, client_flags, emit, output_flag, run_async
from app.output import table
from libs.client.client import Client
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.jobs import (
    MAX_MEMBERS,
    MIN_MEMBERS,
    QUALIFY_ORG,
    AcceleratorRequest,
    Distributed,
    Job,
    JobSpec,
    Metadata,
    PathClass,
    Phase,
    Qualify,
)
from libs.contracts.qualify import Qualification, machine_type, pair_of, qualification_key

WORKLOAD = ["python3", "examples/workloads/allreduce.py"]


def _qualify_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--path", required=True, choices=[p.value for p in PathClass])
    parser.add_argument(
        "--offerings",
        required=True,
        help="the pair of machine types: OFFERING or PROVIDER/OFFERING, twice, joined by '+' "
        "(e.g. lambda/vm+crusoe/vm, vm+container)",
    )
    parser.add_argument(
        "--members",
        type=int,
        default=2,
        help="the gang's size (Relayed only: 2 to 8); the placer then admits Relayed gangs of "
        "up to this many members on these offerings",
    )
    parser.add_argument("--mib", type=int, default=64, help="the all-reduce's tensor size")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    output_flag(parser)
    client_flags(parser, org=False)


def qualification_job(path: PathClass, offerings: str, mib: int, members: int = 2) -> Job:
    if members != 2 and path is not PathClass.RELAYED:
        raise NodusError(
            ErrorCode.INVALID, f"--members {members}: only a Relayed run measures more than a pair"
        )
    if not MIN_MEMBERS <= members <= MAX_MEMBERS:
        raise NodusError(
            ErrorCode.INVALID, f"--members {members}: a gang has {MIN_MEMBERS} to {MAX_MEMBERS}"
        )
    name = f"qualify-{path.value}-{secrets.token_hex(3)}"
    try:
        qualify = msgspec.convert({"path": path.value, "offerings": offerings}, Qualify)
    except msgspec.ValidationError:
        raise NodusError(
            ErrorCode.INVALID,
            f"--offerings {offerings!r}: want OFFERING or PROVIDER/OFFERING twice, joined by '+'",
        ) from None
    return Job(
        metadata=Metadata(name=name, org=QUALIFY_ORG),
        spec=JobSpec(
            command=WORKLOAD,
            env={"ALLREDUCE_MIB": str(mib), "ALLREDUCE_ITERS": "5"},
            distributed=Distributed(
                members=members, transport="Direct" if path is PathClass.DIRECT else "Auto"
            ),
            accelerators=AcceleratorRequest(count=0),
            qualify=qualify,
        ),
    )


async def _rank_results(client: Client, job: Job) -> list[dict[str, Any]]:
    """Each rank's last JSON line (the all-reduce's result), or {} when it printed none."""
    found = []
    for rank in range(job.spec.distributed.members):
        text, offset = "", 0
        while (reply := await client.logs(job.metadata.name, rank, offset, QUALIFY_ORG)).data:
            text, offset = text + reply.data, reply.offset
        lines = [line for line in text.splitlines() if line.startswith("{")]
        try:
            found.append(json.loads(lines[-1]) if lines else {})
        except ValueError:
            found.append({})
    return found


async def run_qualification(
    client: Client,
    path: PathClass,
    offerings: str,
    mib: int = 64,
    timeout: float = 600.0,
    members: int = 2,
) -> Qualification:
    job = qualification_job(path, offerings, mib, members)
    await client.apply(job)
    deadline = time.monotonic() + timeout
    while True:
        current = await client.get_job(job.metadata.name, QUALIFY_ORG)
        if current.status.phase in (Phase.SUCCEEDED, Phase.FAILED):
            break
        if time.monotonic() > deadline:
            await client.delete(job.metadata.name, QUALIFY_ORG)
            raise NodusError(
                ErrorCode.TIMEOUT,
                f"{job.metadata.name} is still {current.status.phase.value} after {timeout:g} s "
                f"(deleted): {[c.message for c in current.status.conditions]}",
            )
        await asyncio.sleep(0.5)
    epoch = await client.epoch(current)
    machines = sorted(m.node for m in epoch.members)
    types = []
    for node in machines:
        found = await client.nodes.get(node)
        inventory = found.value.inventory if found is not None else None
        types.append(machine_type(inventory.provider, inventory.offering) if inventory else node)
    results = await _rank_results(client, current)
    probe = current.status.gang.probe if current.status.gang else None
    verified = all(r.get("verified") is True for r in results)
    buses = [float(r["busGbps"]) for r in results if "busGbps" in r]
    ok = current.status.phase is Phase.SUCCEEDED and verified and probe is not None
    reason = ""
    if not ok:
        reason = next(
            (c.message for c in current.status.conditions if c.status == "False"),
            "the all-reduce did not verify on every rank",
        )
    distinct = sorted(set(types))
    record = Qualification(
        path=path,
        pair=pair_of(distinct[0], distinct[-1]),
        machines=machines,
        ok=ok,
        tcp_gbps=probe.tcp_gbps if probe else 0.0,
        rtt_ms=probe.rtt_ms if probe else 0.0,
        allreduce_bus_gbps=min(buses) if buses else None,
        job=f"{QUALIFY_ORG}/{job.metadata.name}",
        measured_time=now(),
        reason=reason,
        members=members,
    )
    bucket = client.bus.bucket(names.BUCKET_QUALIFICATIONS, Qualification)
    await bucket.put(qualification_key(path, record.pair, members), record)
    return record


COLUMNS = [
    "PATH",
    "PAIR",
    "MEMBERS",
    "QUALIFIED",
    "TCP GBPS",
    "RTT MS",
    "BUS GBPS",
    "MACHINES",
    "MEASURED",
]


def _row(record: Qualification) -> list[str]:
    bus = record.allreduce_bus_gbps
    return [
        record.path.value,
        record.pair,
        str(record.members),
        "yes" if record.ok else f"no: {record.reason}"[:60],
        f"{record.tcp_gbps:g}",
        f"{record.rtt_ms:g}",
        "-" if bus is None else f"{bus:g}",
        ",".join(record.machines),
        age(record.measured_time),
    ]


async def _qualify(args: argparse.Namespace) -> int:
    client = await Client.connect(args.nats, args.credentials)
    try:
        record = await run_qualification(
            client, PathClass(args.path), args.offerings, args.mib, args.timeout, args.members
        )
    finally:
        await client.close()
    if not emit(msgspec.to_builtins(record), args.output):
        print(table(COLUMNS, [_row(record)]))
    return 0 if record.ok else 1


async def _get_qualifications(args: argparse.Namespace) -> int:
    client = await Client.connect(args.nats, args.credentials)
    try:
        found = await client.bus.bucket(names.BUCKET_QUALIFICATIONS, Qualification).snapshot()
    finally:
        await client.close()
    records = sorted(
        (v.value for v in found.values()), key=lambda r: (r.path.value, r.pair, r.members)
    )
    if not emit([msgspec.to_builtins(r) for r in records], args.output):
        if records:
            print(table(COLUMNS, [_row(r) for r in records]))
        else:
            print("no measured qualifications (nodus qualify --path P --offerings A+B)")
        print(
            "# measured runs only; the placer config's `qualified` table may add pairs as an "
            "operator's override",
            file=sys.stderr,
        )
    return 0


QUALIFY = Command(
    "qualify",
    "measure a path on a pair of machine types and record it (G21)",
    _qualify_flags,
    run_async(_qualify),
)
GET_KINDS = [Kind("qualifications", _get_qualifications)]

"""Every admission rule through the real API on a real nats-server: a refused job gets a
readable reason with a stable code, and nothing is written for it."""

from __future__ import annotations

import asyncio
from typing import Any

import nats.errors
import pytest

from libs.bus import Bus
from libs.client.client import Client, parse_job
from libs.contracts import names
from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.jobs import Job
from tests.conftest import StartPlacer
from tests.factories import job, machine, node_record, register

FLEET = [
    machine("h100-a", address="10.0.0.1", privateNetwork="vpc-1", privateAddress="172.16.0.1"),
    machine("h100-b", address="10.0.0.2", privateNetwork="vpc-1", privateAddress="172.16.0.2"),
    machine(
        "mi300-a",
        provider="lambda",
        region="us-west-1",
        address="10.0.1.1",
        accelerators={"count": 8, "backend": "rocm", "model": "MI300X"},
    ),
    machine(
        "mi300-b",
        provider="lambda",
        region="us-west-1",
        address="10.0.1.2",
        accelerators={"count": 8, "backend": "rocm", "model": "MI300X"},
    ),
    machine(
        "l4-box",
        provider="vast",
        region="eu-central-1",
        regionClass="eu",
        offering="container",
        address="10.0.2.1",
        accelerators={"count": 1, "backend": "cuda", "model": "L4"},
    ),
    machine(
        "l4-box2",
        provider="vast",
        region="eu-central-1",
        regionClass="eu",
        offering="container",
        address="10.0.2.2",
        accelerators={"count": 1, "backend": "cuda", "model": "L4"},
    ),
    machine(
        "l4-box3",
        provider="vast",
        region="eu-central-1",
        regionClass="eu",
        offering="container",
        address="10.0.2.3",
        accelerators={"count": 1, "backend": "cuda", "model": "L4"},
    ),
]


@pytest.fixture
async def client(bus: Bus, start_placer: StartPlacer) -> Client:
    await register(bus, [node_record(m) for m in FLEET])
    await start_placer()
    return Client(bus)


async def refused(client: Client, bus: Bus, refused_job: Job) -> NodusError:
    with pytest.raises(NodusError) as caught:
        await client.apply(refused_job)
    jobs = bus.bucket(names.BUCKET_JOBS, Job)
    assert await jobs.get(refused_job.key) is None, "a refused job must leave no record"
    assert await bus.bucket(names.BUCKET_EPOCHS, Job).snapshot() == {}
    return caught.value


CASES: list[tuple[str, dict[str, Any], str, ErrorCode, str]] = [
    ("g1-no-access", {}, "hooli", ErrorCode.ACCESS_DENIED, "no access to distributed jobs"),
    (
        "g8-ld-preload",
        {"env": {"LD_PRELOAD": "/x.so"}, "distributed": {"members": 2, "transport": "Auto"}},
        "acme",
        ErrorCode.LD_PRELOAD_WITH_AUTO,
        "spec.env.LD_PRELOAD",
    ),
    (
        "g2-relayed-three",
        {"accelerators": {"model": "L4"}, "distributed": {"members": 3, "transport": "Auto"}},
        "acme",
        ErrorCode.RELAYED_MEMBERS,
        "nodus qualify --path relayed --members 3",
    ),
    (
        "c5-backend-vars",
        {"accelerators": {"backend": "rocm"}, "env": {"CUDA_VISIBLE_DEVICES": "0"}},
        "acme",
        ErrorCode.BACKEND_MISMATCH,
        "CUDA_VISIBLE_DEVICES",
    ),
    (
        "no-such-model",
        {"accelerators": {"model": "B200"}},
        "acme",
        ErrorCode.UNSATISFIABLE,
        "B200",
    ),
    (
        "g5-direct-needs-vms",
        {"accelerators": {"model": "L4"}, "distributed": {"members": 2, "transport": "Direct"}},
        "acme",
        ErrorCode.UNSATISFIABLE,
        "VMs",
    ),
    (
        "g4-colocated",
        {
            "accelerators": {"backend": "rocm"},
            "distributed": {"members": 3, "network": "Colocated"},
        },
        "acme",
        ErrorCode.UNSATISFIABLE,
        "Colocated",
    ),
    (
        "bad-env-name",
        {"env": {"1BAD": "x"}},
        "acme",
        ErrorCode.INVALID,
        "not a valid environment variable name",
    ),
]


@pytest.mark.parametrize(("name", "spec", "org", "code", "text"), CASES, ids=[c[0] for c in CASES])
async def test_admission_refuses_with_a_readable_reason(
    client: Client, bus: Bus, name: str, spec: dict[str, Any], org: str, code: ErrorCode, text: str
) -> None:
    error = await refused(client, bus, job(name, org=org, **spec))
    assert error.code is code, error
    assert text in error.message


async def test_c6_members_lacking_a_capability_are_refused(
    bus: Bus, start_placer: StartPlacer
) -> None:
    old_agents = [node_record(m, capabilities=["register", "heartbeat"]) for m in FLEET[:2]]
    await register(bus, old_agents)
    await start_placer()
    error = await refused(Client(bus), bus, job("needs-join", accelerators={"model": "H100"}))
    assert error.code is ErrorCode.MISSING_CAPABILITY
    assert "join-epoch" in error.message


async def test_c4_loopback_across_network_namespaces_is_refused(
    bus: Bus, start_placer: StartPlacer
) -> None:
    spread = [
        node_record(machine("lo-a", offering="container", address="127.0.0.5"), namespace="host-a"),
        node_record(machine("lo-b", address="127.0.0.6"), namespace="host-b"),
    ]
    await register(bus, spread)
    await start_placer()
    error = await refused(
        Client(bus), bus, job("loopy", distributed={"members": 2, "transport": "Auto"})
    )
    assert error.code is ErrorCode.UNSATISFIABLE
    assert "relayed" in error.message


async def test_the_same_spec_applied_twice_is_unchanged_and_a_new_spec_is_refused(
    client: Client,
) -> None:
    first = await client.apply(job("twice", accelerators={"model": "H100"}))
    again = await client.apply(job("twice", accelerators={"model": "H100"}))
    assert first.created and not again.created
    with pytest.raises(NodusError) as changed:
        await client.apply(job("twice", accelerators={"model": "H100"}, command=["other"]))
    assert changed.value.code is ErrorCode.IMMUTABLE


@pytest.mark.parametrize(
    ("text", "field"),
    [
        (
            "metadata: {name: x, org: acme}\nspec: {command: [a], distributed: {members: 12}}",
            "$.spec.distributed.members",
        ),
        (
            "metadata: {name: x, org: acme}\nspec: {command: [a], distributed: {members: 2}, colour: red}",
            "colour",
        ),
        (
            "metadata: {name: x, org: acme}\nspec: {command: a, distributed: {members: 2}}",
            "$.spec.command",
        ),
        (
            "metadata: {name: X_Y, org: acme}\nspec: {command: [a], distributed: {members: 2}}",
            "$.metadata.name",
        ),
        (
            "metadata: {name: x, org: acme}\nspec: {command: [a], distributed: {members: 2, network: Moon}}",
            "$.spec.distributed.network",
        ),
        ("metadata: {name: x, org: acme\nspec: [", "not valid YAML"),
    ],
)
def test_malformed_job_files_name_the_field(text: str, field: str) -> None:
    with pytest.raises(NodusError) as refused_file:
        parse_job(text, "job.yaml")
    assert refused_file.value.code is ErrorCode.INVALID
    assert field in refused_file.value.message


async def test_a_malformed_apply_on_the_wire_is_refused_and_writes_nothing(
    client: Client, bus: Bus
) -> None:
    body = (
        b'{"job": {"metadata": {"name": "x", "org": "acme"}, "spec": {"command": ["a"], '
        b'"distributed": {"members": "two"}}}}'
    )
    for _ in range(40):  # a service subscribed an instant ago can be missed for a moment
        try:
            msg = await bus.nc.request(names.API_JOBS_APPLY, body, timeout=5)
            break
        except nats.errors.NoRespondersError:
            await asyncio.sleep(0.05)
    else:
        raise AssertionError("the placer never answered on the apply subject")
    assert msg.headers and msg.headers["Nats-Service-Error-Code"] == "Invalid"
    assert "$.job.spec.distributed.members" in msg.headers["Nats-Service-Error"]
    assert await bus.bucket(names.BUCKET_JOBS, Job).snapshot() == {}

"""Done-when of the gang's life (issue 5), with real processes (`LocalSystem`: nats-server,
placer, prober, two meshed relays, one agent per fleet machine):

- a 4-member Private gang goes from apply to Succeeded running the example all-reduce, probed
  in 2 rounds (4 pairs, then 2: 6 pairs), `status.gang.probe` filled from measured values, the
  workload's data verified on every rank;
- a Relayed pair (container + VM, transport Auto) goes to Succeeded through the relays, its probe
  path `derp:<region>`, its relay bytes billed as mesh-relay GiB and shown by `nodus usage`;
- SIGKILLing a member's agent during the run fences the epoch, a new epoch without the lost
  machine runs and Succeeds, and what was left on the old epoch cannot reach the new gang.

(The prober killed and restarted: test_prober_restart.py.)
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from app.local import REPO, Child, LocalSystem
from libs.bus import Bus
from libs.bus.server import free_port
from libs.client.client import Client
from libs.contracts import names
from libs.contracts.base import decode, now
from libs.contracts.epochs import Epoch, JoinKeyGrant, Lease
from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.jobs import ConditionType, Job, Phase
from libs.contracts.lifecycle import (
    JoinedEpochsReply,
    JoinedEpochsRequest,
    LaunchReply,
    LaunchRequest,
    ProbeServeReply,
    ProbeServeRequest,
    RankStatus,
)
from libs.contracts.relay import Member, RelayRecord, UsageRecord
from libs.relayproto.client import RelayClient
from libs.wg import generate_private_key, key_from_base64, key_to_base64, public_key
from services.agent.boot import new_lab_boot
from services.placer.config import DEFAULT_CONFIG
from services.prober.schedule import rounds
from tests.factories import job

pytestmark = pytest.mark.slow

WORKLOAD = str(REPO / "examples" / "workloads" / "allreduce.py")
SAMPLE_SECONDS = 1.0
L4 = {"count": 1, "backend": "cuda", "model": "L4"}
H100 = {"count": 8, "backend": "cuda", "model": "H100"}


def vm_in_vpc(name: str, index: int) -> dict[str, Any]:
    """A VM of one provider region on one private network: members talk over 127.0.2.x."""
    return {
        "name": name,
        "provider": "aws",
        "region": "us-east-1",
        "regionClass": "us",
        "offering": "vm",
        "address": f"127.0.1.{index}",
        "privateNetwork": "lifecycle-vpc",
        "privateAddress": f"127.0.2.{index}",
        "privateInterface": "ens5",
        "pool": "h100",
        "cluster": "us",
        "accelerators": H100,
    }


def eu_machine(name: str, offering: str, index: int) -> dict[str, Any]:
    """An L4 machine in the eu region class; a container has no network device (Relayed)."""
    return {
        "name": name,
        "provider": "vast" if offering == "container" else "lambda",
        "region": "eu-central-1",
        "regionClass": "eu",
        "offering": offering,
        "address": f"127.0.1.{index}",
        "pool": "l4",
        "cluster": "eu",
        "accelerators": L4,
    }


@contextlib.asynccontextmanager
async def local_system(
    tmp_path: Path,
    machines: list[dict[str, Any]],
    heartbeat_timeout_seconds: float | None = None,
    sample_seconds: float = SAMPLE_SECONDS,
) -> AsyncIterator[tuple[LocalSystem, Client, Bus]]:
    """The whole system as processes on the fleet `machines`; always stopped on the way out."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(yaml.safe_dump({"machines": machines}))
    config: Path | None = None
    if heartbeat_timeout_seconds is not None:
        settings = yaml.safe_load(DEFAULT_CONFIG.read_text())
        settings["heartbeatTimeoutSeconds"] = heartbeat_timeout_seconds
        config = tmp_path / "placer.yaml"
        config.write_text(yaml.safe_dump(settings))
    system = LocalSystem(
        fleet_path=fleet,
        state_dir=tmp_path / "state",
        nats_port=free_port(),
        probe_seconds=sample_seconds,
        heartbeat_seconds=0.5,
        placer_config=config,
    )
    await system.start(timeout=90)  # stops what it started if it fails
    client: Client | None = None
    bus: Bus | None = None
    try:
        client = await Client.connect(system.url)
        bus = await Bus.open(system.url, name="lifecycle-test", buckets=names.ALL_BUCKETS)
        yield system, client, bus
    finally:
        if bus is not None:
            await bus.close()
        if client is not None:
            await client.close()
        system.stop()


async def wait_job(
    client: Client,
    system: LocalSystem,
    name: str,
    until: Callable[[Job], bool],
    timeout: float,
    what: str,
) -> Job:
    """Poll the job until `until` holds; on timeout say what it looked like and where logs are."""
    deadline = time.monotonic() + timeout
    last: Job | None = None
    while time.monotonic() < deadline:
        last = await client.get_job(name)
        if until(last):
            return last
        await asyncio.sleep(0.1)
    status = last.status if last else None
    raise AssertionError(
        f"{name}: {what} did not happen within {timeout:g}s; last status {status}; "
        f"logs in {system.state_dir / 'logs'}"
    )


def ended(job: Job) -> bool:
    return job.status.phase in (Phase.SUCCEEDED, Phase.FAILED)


async def rank_reports(client: Client, name: str, ranks: int) -> list[dict[str, Any]]:
    """The last line of every rank's log (`nodus logs NAME --rank N`): the workload's report."""
    reports = []
    for rank in range(ranks):
        logs = await client.logs(name, rank)
        lines = logs.data.strip().splitlines()
        assert lines, f"rank {rank} of {name} printed nothing"
        reports.append(json.loads(lines[-1]))
    return reports


# -- a. four members, Private path ---------------------------------------------------------------


async def test_a_four_member_gang_is_probed_in_two_rounds_and_runs_the_allreduce_to_succeeded(
    tmp_path: Path,
) -> None:
    machines = [vm_in_vpc(f"h100-{c}", 81 + i) for i, c in enumerate("abcd")]
    async with local_system(tmp_path, machines) as (system, client, _):
        await client.apply(
            job(
                "ring4",
                org="acme",
                command=[sys.executable, WORKLOAD],
                env={"ALLREDUCE_MIB": "4", "ALLREDUCE_ITERS": "2"},
                accelerators={"model": "H100"},
                distributed={"members": 4, "network": "Colocated", "transport": "Direct"},
            )
        )
        done = await wait_job(client, system, "ring4", ended, 150, "the end of the run")
        reports = await rank_reports(client, "ring4", 4)
        assert done.status.phase is Phase.SUCCEEDED, (done.status.conditions, reports)
        assert done.status.epoch == 1
        gang = done.status.gang
        assert gang is not None and gang.transport.value == "private"
        assert sorted(m.address for m in gang.members) == [f"127.0.2.{81 + i}" for i in range(4)]

        # status.gang.probe: the slowest pair, from measured values (G11).
        probe = gang.probe
        assert probe is not None
        assert probe.tcp_gbps > 0 and probe.rtt_ms > 0 and probe.path == "direct"
        qualified = done.condition(ConditionType.NETWORK_QUALIFIED)
        assert qualified is not None and qualified.status == "True"
        assert qualified.reason == "ProbePassed" and "6 pairs measured" in qualified.message

        # Every pair measured once, in N/2 = 2 rounds where no member sends two samples nor
        # receives two at once; 3 fresh connections each way per pair (G10.1).
        record = await client.probe(done)
        assert record is not None and record.state == "Qualified"
        assert record.rounds == 2 and len(record.pairs) == 6
        nodes = [m.node for m in sorted(gang.members, key=lambda m: m.rank)]
        assert {frozenset((p.a, p.b)) for p in record.pairs} == {
            frozenset(pair) for pair in itertools.combinations(nodes, 2)
        }
        schedule = rounds(nodes)
        assert [len(r) for r in schedule] == [4, 2]
        assert [[(p.a, p.b) for p in record.pairs[i:j]] for i, j in ((0, 4), (4, 6))] == schedule
        for pair in record.pairs:
            assert pair.ok and pair.path == "direct" and pair.connections == 6, pair
            assert pair.tcp_gbps > 0 and pair.rtt_ms > 0, pair
        assert min(p.tcp_gbps for p in record.pairs) == probe.tcp_gbps
        assert max(p.rtt_ms for p in record.pairs) == probe.rtt_ms
        times = [[p.measured_time for p in record.pairs[i:j]] for i, j in ((0, 4), (4, 6))]
        for earlier, later in itertools.pairwise(times):
            # A round starts when the previous one ended and samples for SAMPLE_SECONDS.
            assert all(a is not None for a in [*earlier, *later])
            gap = min(t for t in later if t) - max(t for t in earlier if t)
            assert gap.total_seconds() >= SAMPLE_SECONDS * 0.9, times

        # The workload's data verified on every rank, over the private addresses.
        for rank, report in enumerate(reports):
            assert report["rank"] == rank and report["world"] == 4, report
            assert report["verified"] is True, report
        billing = done.status.billing
        assert billing is not None and billing.boot_seconds > 0 and billing.run_seconds > 0
        assert billing.mesh_relay_gi_b == 0  # Private adds nothing (G17)


# -- b. a Relayed pair -----------------------------------------------------------------------------


async def test_b_a_relayed_pair_runs_through_the_relays_and_bills_mesh_relay_bytes(
    tmp_path: Path,
) -> None:
    machines = [eu_machine("vast-r", "container", 86), eu_machine("lam-r", "vm", 87)]
    async with local_system(tmp_path, machines) as (system, client, bus):
        await client.apply(
            job(
                "pair",
                org="acme",
                command=[sys.executable, WORKLOAD],
                env={"ALLREDUCE_MIB": "4", "ALLREDUCE_ITERS": "2"},
                accelerators={"model": "L4"},
                distributed={"members": 2, "transport": "Auto"},
            )
        )
        done = await wait_job(client, system, "pair", ended, 150, "the end of the run")
        reports = await rank_reports(client, "pair", 2)
        assert done.status.phase is Phase.SUCCEEDED, (done.status.conditions, reports)
        gang = done.status.gang
        assert gang is not None and gang.transport.value == "relayed"
        relays = await bus.bucket(names.BUCKET_RELAYS, RelayRecord).snapshot()
        regions = {f"derp:{r.value.region}" for r in relays.values()}
        probe = gang.probe
        assert probe is not None and probe.tcp_gbps > 0 and probe.rtt_ms > 0
        assert re.fullmatch(r"derp:[a-z0-9-]+", probe.path) and probe.path in regions, probe
        record = await client.probe(done)
        assert record is not None and record.rounds == 1 and len(record.pairs) == 1
        assert record.pairs[0].connections == 6 and record.pairs[0].path in regions
        for rank, report in enumerate(reports):
            assert report["rank"] == rank and report["world"] == 2 and report["verified"], report

        billing = done.status.billing
        assert billing is not None and billing.boot_seconds > 0 and billing.run_seconds > 0
        assert billing.mesh_relay_gi_b > 0  # the probe and the all-reduce crossed the relays
        usage = await client.usage()
        assert usage.get(done.key, 0) > 0, usage


# -- c. a member lost during the run ---------------------------------------------------------------

SLEEPER = "import sys, time; time.sleep(float(sys.argv[1]))"
RUN_SECONDS = 8.0
HEARTBEAT_TIMEOUT = 4.0


def agent_of(system: LocalSystem, node: str) -> Child:
    return next(c for c in system.children if c.name == f"agent-{node}")


def kill_marked_processes(marker: str) -> None:
    """Ranks outlive a SIGKILLed agent (their own session): end the ones this test started."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker.encode() in argv:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)


async def relay_hello(
    relay: RelayRecord, gang: str, epoch: int, node: str, private: bytes, public: bytes
) -> RelayClient:
    """Connect to a relay as a member: the challenge, a Hello with the proof made with
    `private` for the key `public`; the relay answers Welcome or refuses (NodusError)."""
    client = RelayClient(
        relay.name, relay.address, gang, epoch, node, private, public, lambda src, msg: None
    )
    await client.connect()
    return client


async def refusal(
    relay: RelayRecord, gang: str, epoch: int, node: str, private: bytes, public: bytes
) -> str:
    """What the relay answers a Hello: Welcome, or the code of its refusal."""
    try:
        client = await relay_hello(relay, gang, epoch, node, private, public)
    except NodusError as error:  # "relay NAME refused: CODE: why"
        found = re.search(r"refused: (\w+): ", error.message)
        assert found, error.message
        return found.group(1)
    client.close()
    return "Welcome"


async def test_c_a_killed_member_fences_its_epoch_and_the_gang_runs_again_in_a_new_epoch(
    tmp_path: Path,
) -> None:
    """Two containers and a VM (any two of them make a Relayed pair, so the gang can be
    re-placed without the lost machine). The job sleeps RUN_SECONDS; the agent of one member is
    SIGKILLed while epoch 1 runs. The placer sees the heartbeats stop, fences epoch 1 and places
    epoch 2 on the survivor and the third machine, which runs to Succeeded.

    Why the old member cannot reach the new gang, proven where it is enforced (G9, S2, C2):

    - The relays. A killed agent's WireGuard private key died with it (its Member record in
      `nodus-members` holds only the public key), so it cannot be replayed. Instead, while
      epoch 1 is live, the test records a member of its own in epoch 1 exactly as an agent does
      on joining (a fresh WireGuard key bound to the epoch in `nodus-members`) and proves the
      relays admit it (Welcome: these are real epoch-1 credentials, by the relays' own rules;
      the test can write that record only because S1's bus permissions are not configured
      yet). It keeps one session open. Once epoch 1 is fenced: the relay closes that session, and a
      new connection with the same valid proof is refused with NotAMember on both relays; the
      lost member's own recorded key, which the relays recognised before the kill (a wrong
      proof got BadProof, not NotAMember), is refused with NotAMember too. Without a session,
      nothing stamped with epoch 1 enters the relays, so nothing reaches epoch 2's members.
    - The agents. The survivor's epoch-1 join key (single-use, 15 min, signed by epoch 1's
      mesh identity), copied before the kill, is offered to it again once it is on epoch 2:
      it is refused with StaleEpoch ("this node is on epoch 2"), and requests stamped with
      epoch 1 (probe-serve, launch) are refused with StaleEpoch where they arrive.
    """
    machines = [
        eu_machine("vast-x", "container", 91),
        eu_machine("vast-y", "container", 92),
        eu_machine("lam-z", "vm", 93),
    ]
    marker = f"nodus-lifecycle-{os.getpid()}-{tmp_path.name}"
    sessions: list[RelayClient] = []
    held: list[asyncio.Task[None]] = []
    try:
        async with local_system(tmp_path, machines, HEARTBEAT_TIMEOUT) as (system, client, bus):
            await _lose_a_member_during_the_run(system, client, bus, marker, sessions, held)
    finally:
        for session in sessions:
            session.close()
        for task in held:
            task.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        kill_marked_processes(marker)


async def _lose_a_member_during_the_run(
    system: LocalSystem,
    client: Client,
    bus: Bus,
    marker: str,
    sessions: list[RelayClient],
    held: list[asyncio.Task[None]],
) -> None:
    members_bucket = bus.bucket(names.BUCKET_MEMBERS, Member)
    joinkeys = bus.bucket(names.BUCKET_JOINKEYS, JoinKeyGrant)
    epochs = bus.bucket(names.BUCKET_EPOCHS, Epoch)
    relays = [
        r.value for r in (await bus.bucket(names.BUCKET_RELAYS, RelayRecord).snapshot()).values()
    ]
    assert len(relays) == 2
    await client.apply(
        job(
            "phoenix",
            org="acme",
            command=[sys.executable, "-c", SLEEPER, str(RUN_SECONDS), marker],
            accelerators={"model": "L4"},
            distributed={"members": 2, "transport": "Auto"},
        )
    )
    gang = "acme.phoenix"

    first = await wait_job(
        client,
        system,
        "phoenix",
        lambda j: j.status.phase is Phase.RUNNING and j.status.epoch == 1,
        90,
        "epoch 1 Running",
    )
    assert first.status.gang is not None and first.status.gang.transport.value == "relayed"
    lost, survivor = (m.node for m in sorted(first.status.gang.members, key=lambda m: m.rank))
    third = next(m["name"] for m in fleet_machines(system) if m["name"] not in (lost, survivor))

    # Epoch-1 credentials the relays accept: a member recorded the way an agent records itself.
    ghost_private = generate_private_key()
    ghost_public = public_key(ghost_private)
    created = await members_bucket.create(
        names.member_key(gang, 1, "ghost"),
        Member(
            gang=gang,
            epoch=1,
            node="ghost",
            rank=2,
            address="127.0.1.199",
            wg_public_key=key_to_base64(ghost_public),
            joined_time=now(),
        ),
    )
    assert created is not None
    for relay in relays:
        for _ in range(50):  # the relays learn the record from their watch
            try:
                sessions.append(
                    await relay_hello(relay, gang, 1, "ghost", ghost_private, ghost_public)
                )
                break
            except NodusError:
                await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"{relay.name} never admitted an epoch-1 member")
    held += [asyncio.create_task(s.run()) for s in sessions]
    lost_member = await members_bucket.get(names.member_key(gang, 1, lost))
    assert lost_member is not None
    lost_public = key_from_base64(lost_member.value.wg_public_key)
    for relay in relays:  # the lost member's key is a live member's: only the proof is wrong
        answer = await refusal(relay, gang, 1, lost, generate_private_key(), lost_public)
        assert answer == "BadProof", answer
    old_grant = await joinkeys.get(names.joinkey_key(survivor, gang, 1))
    assert old_grant is not None

    agent = agent_of(system, lost)
    os.kill(agent.process.pid, signal.SIGKILL)
    agent.process.wait(timeout=10)

    second = await wait_job(
        client,
        system,
        "phoenix",
        lambda j: j.status.phase is Phase.RUNNING and j.status.epoch == 2,
        60,
        "epoch 2 Running",
    )
    assert second.status.gang is not None
    assert {m.node for m in second.status.gang.members} == {survivor, third}
    assert second.status.gang.transport.value == "relayed"
    assert lost in second.status.avoid
    old = await epochs.get(names.epoch_key(gang, 1))
    assert old is not None and old.value.fenced  # fenced first (G9)
    events = [(e.kind, e.epoch, e.message) for e in await client.events(second)]
    # Whoever saw it first: the placer (heartbeats stopped) or the monitor (the host does not
    # answer: R17's host-unreachable); either ends epoch 1 without the member.
    lost_by = ("MemberLost", "FaultBrokeMember")
    assert any(k in lost_by and e == 1 and lost in m for k, e, m in events), events

    # The relays: the open epoch-1 sessions were closed, and epoch-1 credentials are refused.
    _, pending = await asyncio.wait(held, timeout=10)
    assert not pending, "a relay kept an epoch-1 session open after the fence"
    for relay in relays:
        answer = await refusal(relay, gang, 1, "ghost", ghost_private, ghost_public)
        assert answer == "NotAMember", answer
        answer = await refusal(relay, gang, 1, lost, generate_private_key(), lost_public)
        assert answer == "NotAMember", answer

    # The survivor is on epoch 2 only; messages and keys stamped with epoch 1 are refused.
    joined = await bus.request(
        names.node_request(survivor, names.AgentVerb.EPOCHS),
        JoinedEpochsRequest(),
        JoinedEpochsReply,
    )
    assert [(e.gang, e.epoch) for e in joined.epochs] == [(gang, 2)]
    for verb, body, kind in (
        (names.AgentVerb.PROBE_SERVE, ProbeServeRequest(gang=gang, epoch=1), ProbeServeReply),
        (
            names.AgentVerb.LAUNCH,
            LaunchRequest(gang=gang, epoch=1, rank=1, command=["true"]),
            LaunchReply,
        ),
    ):
        with pytest.raises(NodusError) as refused:
            await bus.request(names.node_request(survivor, verb), body, kind)
        assert refused.value.code is ErrorCode.STALE_EPOCH, (verb, refused.value)
    replayed = names.joinkey_key(survivor, gang, 1)
    await joinkeys.put(replayed, old_grant.value)
    log = agent_of(system, survivor).log
    deadline = time.monotonic() + 10
    refusals: list[str] = []
    while time.monotonic() < deadline and not refusals:
        refusals = [
            line
            for line in log.read_text(errors="replace").splitlines()
            if "join refused" in line and "epoch 1" in line
        ]
        await asyncio.sleep(0.1)
    await joinkeys.delete(replayed)
    assert refusals, f"the survivor never judged the replayed epoch-1 join key ({log})"
    message = json.loads(refusals[-1])["msg"]
    assert "StaleEpoch" in message and "this node is on epoch 2" in message, message
    joined = await bus.request(
        names.node_request(survivor, names.AgentVerb.EPOCHS),
        JoinedEpochsRequest(),
        JoinedEpochsReply,
    )
    assert [(e.gang, e.epoch) for e in joined.epochs] == [(gang, 2)]

    # Epoch 2 runs to the end.
    final = await wait_job(client, system, "phoenix", ended, 60, "the end of epoch 2")
    assert final.status.phase is Phase.SUCCEEDED, final.status.conditions
    assert final.status.epoch == 2
    ready = final.condition(ConditionType.GANG_READY)
    assert ready is not None and ready.reason == "Completed"


async def test_e_a_machine_that_booted_again_at_once_ends_its_epoch_and_its_old_ranks_stop(
    tmp_path: Path,
) -> None:
    """A machine that crashed and booted again before its heartbeats could time out: its
    tunnels and its join of epoch 1 died with the boot. The placer sees the new boot id and
    ends epoch 1 at once (it does not wait for a heartbeat timeout that never comes), the
    agent of the new boot stops the rank the old boot left running in the lab and records it
    Stopped, and epoch 2 runs to Succeeded. (Found by the chaos run: the gang stayed Running
    forever on a rank nobody watched.) An agent restarted on the same boot is no boot at all:
    tests/e2e/test_agent_restart.py."""
    machines = [
        eu_machine("vast-x", "container", 91),
        eu_machine("vast-y", "container", 92),
        eu_machine("lam-z", "vm", 93),
    ]
    marker = f"nodus-reboot-{os.getpid()}-{tmp_path.name}"
    # Far longer than the test: only the boot id can end epoch 1 in time.
    slow_heartbeat_timeout = 120.0
    try:
        async with local_system(tmp_path, machines, slow_heartbeat_timeout) as (
            system,
            client,
            bus,
        ):
            await client.apply(
                job(
                    "lazarus",
                    org="acme",
                    command=[sys.executable, "-c", SLEEPER, str(RUN_SECONDS), marker],
                    accelerators={"model": "L4"},
                    distributed={"members": 2, "transport": "Auto"},
                )
            )
            first = await wait_job(
                client,
                system,
                "lazarus",
                lambda j: j.status.phase is Phase.RUNNING and j.status.epoch == 1,
                90,
                "epoch 1 Running",
            )
            assert first.status.gang is not None
            rank0 = min(first.status.gang.members, key=lambda m: m.rank)
            lost = rank0.node
            key = names.rank_key("acme.lazarus", 1, rank0.rank, lost)
            remembered = system.machine_dir(lost) / "logs" / f"{key}.pid"
            # Written before the launch answered, so before the job said Running.
            assert remembered.exists(), f"the agent kept no record of rank 0's process ({key})"
            pid = json.loads(remembered.read_text())["pid"]

            agent = agent_of(system, lost)
            os.kill(agent.process.pid, signal.SIGKILL)
            agent.process.wait(timeout=10)
            assert process_alive(pid), "the rank died with its agent: nothing to prove"
            new_lab_boot(system.machine_dir(lost))  # the machine boots again
            system.restart(agent.name)

            second = await wait_job(
                client,
                system,
                "lazarus",
                lambda j: j.status.epoch == 2 and j.status.phase is Phase.RUNNING,
                60,
                "epoch 2 Running",
            )
            assert second.status.gang is not None
            assert lost not in {m.node for m in second.status.gang.members}
            events = [(e.kind, e.epoch, e.message) for e in await client.events(second)]
            assert any(
                k == "MemberLost" and e == 1 and f"{lost} booted again" in m for k, e, m in events
            ), events
            assert not process_alive(pid), "the previous boot's rank still runs"
            status = await bus.bucket(names.BUCKET_RANKS, RankStatus).get(key)
            assert status is not None and status.value.state == "Stopped", status
            final = await wait_job(client, system, "lazarus", ended, 60, "the end of epoch 2")
            assert final.status.phase is Phase.SUCCEEDED, final.status.conditions
            assert final.status.epoch == 2
    finally:
        kill_marked_processes(marker)


def process_alive(pid: int) -> bool:
    """Running, not a zombie waiting to be reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def fleet_machines(system: LocalSystem) -> list[dict[str, Any]]:
    machines: list[dict[str, Any]] = yaml.safe_load(system.fleet_path.read_text())["machines"]
    return machines


# -- found while writing the tests above ----------------------------------------------------------


async def usage_records(bus: Bus, gang: str) -> list[UsageRecord]:
    """Every usage record the relays published for `gang` (the NODUS_USAGE stream)."""
    records: list[UsageRecord] = []
    sub = await bus.js.subscribe(f"nodus.usage.*.{gang}", ordered_consumer=True)
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=0.5)
            except Exception:  # nothing more within the timeout
                break
            records.append(decode(msg.data, UsageRecord))
            if msg.metadata.num_pending == 0:
                break
    finally:
        await sub.unsubscribe()
    return records


async def test_b_the_bill_counts_every_relay_byte_the_run_sent(tmp_path: Path) -> None:
    """G17, issue 5 (6): `status.billing.meshRelayGiB` is the bytes the relays measured. The
    relays publish their counts once a second; every record that began before the job's
    finishedTime holds bytes the run sent, so the bill must cover at least their sum (and
    `nodus usage` must not show more for the job than it was billed for its run).

    Fails today: the prober sums the usage stream the instant the last rank exits, before the
    relays' last flush, so up to the last second of the run's relay bytes is never billed."""
    machines = [eu_machine("vast-s", "container", 88), eu_machine("lam-s", "vm", 89)]
    async with local_system(tmp_path, machines) as (system, client, bus):
        await client.apply(
            job(
                "metered",
                org="acme",
                command=[sys.executable, WORKLOAD],
                env={"ALLREDUCE_MIB": "8", "ALLREDUCE_ITERS": "2"},
                accelerators={"model": "L4"},
                distributed={"members": 2, "transport": "Auto"},
            )
        )
        done = await wait_job(client, system, "metered", ended, 150, "the end of the run")
        assert done.status.phase is Phase.SUCCEEDED, done.status.conditions
        assert done.status.billing is not None and done.status.finished_time is not None
        await asyncio.sleep(3.0)  # three flush intervals: every relay count has landed
        records = await usage_records(bus, done.key)
        finished = done.status.finished_time
        during_run = sum(r.bytes_sent for r in records if r.start_time < finished)
        billed = round(done.status.billing.mesh_relay_gi_b * 2**30)
        late = [
            (r.relay, r.node, r.bytes_sent, r.start_time.isoformat(), r.end_time.isoformat())
            for r in records
            if r.start_time < finished < r.end_time
        ]
        assert billed >= during_run, (
            f"billed {billed} bytes, but the relays metered {during_run} bytes in records that "
            f"began before finishedTime {finished.isoformat()}; {during_run - billed} bytes "
            f"unbilled; records still open at the end: {late}"
        )


async def test_d_a_gang_that_ended_gives_its_machines_back(tmp_path: Path) -> None:
    """An operator expects a Job that has Succeeded to hold no machines: the next Job that
    needs them is placed on them. T2 also keeps only running gangs in the global ranktable.
    (A finished gang used to keep its leases until `nodus delete`; the placer now tears the
    epoch of a finished gang down.)"""
    machines = [vm_in_vpc("h100-p", 95), vm_in_vpc("h100-q", 96)]
    async with local_system(tmp_path, machines) as (system, client, bus):
        spec = {
            "command": [sys.executable, "-c", "pass"],
            "accelerators": {"model": "H100"},
            "distributed": {"members": 2, "network": "Colocated", "transport": "Direct"},
        }
        await client.apply(job("first", org="acme", **spec))
        first = await wait_job(client, system, "first", ended, 60, "the end of the first job")
        assert first.status.phase is Phase.SUCCEEDED, first.status.conditions
        await client.apply(job("second", org="acme", **spec))
        deadline = time.monotonic() + 30
        second = await client.get_job("second")
        while time.monotonic() < deadline and not ended(second):
            await asyncio.sleep(0.2)
            second = await client.get_job("second")
        leases = await bus.bucket(names.BUCKET_LEASES, Lease).snapshot()
        ranktables = await client.global_ranktable()
        held = {node: (v.value.gang, v.value.epoch) for node, v in leases.items()}
        listed = {gang: v.value.phase for gang, v in ranktables.items()}
        ready = second.condition(ConditionType.GANG_READY)
        assert second.status.phase is Phase.SUCCEEDED, (
            f"second job {second.status.phase.value} ({ready.reason if ready else None}: "
            f"{ready.message if ready else None}) 30 s after the first Succeeded; "
            f"leases {held}; global ranktable {listed}"
        )
        assert "acme.first" not in listed, f"a finished gang in the global ranktable: {listed}"

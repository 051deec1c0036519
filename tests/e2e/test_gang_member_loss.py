"""Done-when of the gang's life (issue 5), a member lost during the run: SIGKILLing a member's
agent fences the epoch, a new epoch without the lost machine runs and Succeeds, and what was
left on the old epoch cannot reach the new gang; a machine that booted again at once ends its
epoch and its old ranks stop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from app.local import Child, LocalSystem
from libs.bus import Bus
from libs.client.client import Client
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.epochs import Epoch, JoinKeyGrant
from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.jobs import ConditionType, Phase
from libs.contracts.lifecycle import (
    JoinedEpochsReply,
    JoinedEpochsRequest,
    LaunchReply,
    LaunchRequest,
    ProbeServeReply,
    ProbeServeRequest,
    RankStatus,
)
from libs.contracts.relay import Member, RelayRecord
from libs.relayproto.client import RelayClient
from libs.wg import generate_private_key, key_from_base64, key_to_base64, public_key
from services.agent.boot import new_lab_boot
from tests.e2e.gang_system import SLEEPER, ended, eu_machine, local_system, wait_job
from tests.factories import job

pytestmark = pytest.mark.slow


# -- c. a member lost during the run ---------------------------------------------------------------

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
            events = [(e.kind, e.epoch, e.message) for e in await client.events(second)]
            assert lost not in {m.node for m in second.status.gang.members}, (
                events,
                placer_said(system, "lazarus"),
            )
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


def placer_said(system: LocalSystem, about: str) -> list[str]:
    """What the placers logged of a job: why it went where it went, when a test asks."""
    return [
        line
        for path in sorted((system.state_dir / "logs").glob("placer-*.log"))
        for line in path.read_text(errors="replace").splitlines()
        if about in line
    ]


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

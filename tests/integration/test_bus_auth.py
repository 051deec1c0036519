"""S1 on a real nats-server: nobody connects without a key, and an agent's own key lets it do
its node's work and nothing else. Every refusal below is the server's (a permissions
violation it reports), not a check of ours."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import nats
import nats.errors
import pytest
from nats.aio.client import Client as NatsClient
from nats.js.kv import KeyValue

from libs.bus import Bus
from libs.bus.auth import AGENT, AGENT_BUCKETS, RELAY, agent_inbox
from libs.bus.connection import connect, credential_options
from libs.bus.server import NatsServer
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.epochs import JoinKeyGrant
from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.fleet import NodeHealth
from libs.contracts.relay import Member

REFUSAL_WAIT = 1.0  # a refused request gets no answer; the server says why at once


@dataclass
class Confined:
    nc: NatsClient
    errors: list[str] = field(default_factory=list)

    async def refused(self, what: str) -> bool:
        """Did the server report a violation naming `what` (lower-cased in its message)?"""
        for _ in range(50):
            if any("permissions violation" in e and what.lower() in e for e in self.errors):
                return True
            await asyncio.sleep(0.02)
        return False


async def connect_confined(server: NatsServer, seed: str, inbox: str = "_INBOX") -> Confined:
    """A raw client on `seed`'s user: every refusal the server reports is kept."""
    confined = Confined(nc=None)  # type: ignore[arg-type]

    async def on_error(error: Exception) -> None:
        confined.errors.append(str(error).lower())

    confined.nc = await nats.connect(
        server.url,
        error_cb=on_error,
        inbox_prefix=inbox,
        allow_reconnect=False,
        **credential_options(seed),
    )
    return confined


@pytest.fixture
async def agent_a(nats_server: NatsServer, bus: Bus) -> AsyncIterator[Confined]:
    """node-a's agent, on its own key; the operator's `bus` made the journal and wrote what
    belongs to node-b and to another gang."""
    grants = bus.bucket(names.BUCKET_JOINKEYS, JoinKeyGrant)
    await grants.put("node-a.acme.train.1", JoinKeyGrant(token="for-a", verify_key="v"))
    await grants.put("node-b.globex.rl.3", JoinKeyGrant(token="secret-of-b", verify_key="v"))
    confined = await connect_confined(
        nats_server, nats_server.user("agent-node-a", AGENT, "node-a"), agent_inbox("node-a")
    )
    yield confined
    await confined.nc.close()


async def test_a_client_without_a_key_cannot_connect(
    nats_server: NatsServer, bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(Exception) as anonymous:
        await nats.connect(nats_server.url, allow_reconnect=False, connect_timeout=2)
    assert "authorization" in str(anonymous.value).lower()
    # Our own connect says so in words, and names what to pass.
    monkeypatch.delenv("NODUS_CREDENTIALS")
    with pytest.raises(NodusError) as ours:
        await connect(nats_server.url, initial_attempts=1)
    assert ours.value.code is ErrorCode.UNAUTHORIZED
    assert "NODUS_CREDENTIALS" in ours.value.message


async def test_an_agent_does_its_own_nodes_work(nats_server: NatsServer, bus: Bus) -> None:
    """The agent's bus use, through our Bus with its own key: it opens its buckets, writes its
    health, reads the join keys addressed to it and what peers addressed to it."""
    seed = nats_server.user("agent-node-a", AGENT, "node-a")
    peers = bus.bucket(names.BUCKET_PEERS, Member)
    record = Member(
        gang="acme.train",
        epoch=1,
        node="node-b",
        rank=1,
        address="a",
        wg_public_key="k",
        joined_time=now(),
    )
    await peers.put(names.peer_key("acme.train", 1, "node-a", "node-b"), record)
    agent = await Bus.open(
        nats_server.url,
        credentials=seed,
        buckets=AGENT_BUCKETS,
        inbox_prefix=agent_inbox("node-a"),
        confined=True,
    )
    try:
        health = agent.bucket(names.BUCKET_HEALTH, NodeHealth)
        beat = NodeHealth(node="node-a", healthy=True, heartbeat_time=now(), boot_id="b")
        assert await health.put("node-a", beat) > 0
        mine = await agent.bucket(names.BUCKET_PEERS, Member).snapshot("acme.train.1.node-a.*")
        assert [v.value.node for v in mine.values()] == ["node-b"]
        # None of its own: the last of its keys is "not found" (no stream question asked).
        assert await agent.bucket(names.BUCKET_JOINKEYS, JoinKeyGrant).snapshot("node-a.>") == {}
        await agent.bucket(names.BUCKET_PEERS, Member).put(
            names.peer_key("acme.train", 1, "node-b", "node-a"),
            Member(
                gang="acme.train",
                epoch=1,
                node="node-a",
                rank=0,
                address="b",
                wg_public_key="k",
                joined_time=now(),
            ),
        )
    finally:
        await agent.close()


async def test_an_agent_cannot_write_another_nodes_health(agent_a: Confined) -> None:
    js = agent_a.nc.jetstream(timeout=REFUSAL_WAIT)
    with pytest.raises(nats.errors.TimeoutError):
        await js.publish("$KV.nodus-health.node-b", b"{}")
    assert await agent_a.refused("$kv.nodus-health.node-b")


async def test_an_agent_cannot_read_another_gangs_join_key(agent_a: Confined) -> None:
    with pytest.raises(nats.errors.TimeoutError):  # get by key
        await agent_a.nc.request(
            "$JS.API.DIRECT.GET.KV_nodus-joinkeys.$KV.nodus-joinkeys.node-b.globex.rl.3",
            b"",
            timeout=REFUSAL_WAIT,
        )
    assert await agent_a.refused("$kv.nodus-joinkeys.node-b.globex.rl.3")
    with pytest.raises(nats.errors.TimeoutError):  # by sequence: names no key, so refused
        await agent_a.nc.request(
            "$JS.API.DIRECT.GET.KV_nodus-joinkeys", b'{"seq": 2}', timeout=REFUSAL_WAIT
        )
    assert await agent_a.refused('"$js.api.direct.get.kv_nodus-joinkeys"')
    with pytest.raises(nats.errors.TimeoutError):  # the stream's messages by the old API
        await agent_a.nc.request(
            "$JS.API.STREAM.MSG.GET.KV_nodus-joinkeys", b'{"seq": 2}', timeout=REFUSAL_WAIT
        )
    assert await agent_a.refused("$js.api.stream.msg.get.kv_nodus-joinkeys")
    # The last of every key, or of another node's: a direct read naming them, refused.
    for keys in (">", "node-b.>", "*.globex.>"):
        with pytest.raises(nats.errors.TimeoutError):
            await agent_a.nc.request(
                f"$JS.API.DIRECT.GET.KV_nodus-joinkeys.$KV.nodus-joinkeys.{keys}",
                b"",
                timeout=REFUSAL_WAIT,
            )
        assert await agent_a.refused(f"$kv.nodus-joinkeys.{keys}")
    # The stream's description would list every key's name (other nodes' gangs): refused.
    with pytest.raises(nats.errors.TimeoutError):
        await agent_a.nc.request(
            "$JS.API.STREAM.INFO.KV_nodus-joinkeys", b'{"subjects_filter": ">"}', timeout=1
        )
    assert await agent_a.refused("$js.api.stream.info.kv_nodus-joinkeys")
    # A watch of every key, or of another node's: its consumer is refused.
    js = agent_a.nc.jetstream(timeout=REFUSAL_WAIT)
    kv = KeyValue(
        name=names.BUCKET_JOINKEYS,
        stream="KV_nodus-joinkeys",
        pre="$KV.nodus-joinkeys.",
        js=js,
        direct=True,
    )
    with pytest.raises(nats.errors.TimeoutError):
        await kv.watch("node-b.>")
    assert await agent_a.refused("$js.api.consumer.create.kv_nodus-joinkeys")


async def test_an_agent_cannot_subscribe_to_nodus_or_other_inboxes(agent_a: Confined) -> None:
    await agent_a.nc.subscribe("nodus.>")
    assert await agent_a.refused('subscription to "nodus.>"')
    await agent_a.nc.subscribe("_INBOX.>")
    assert await agent_a.refused('subscription to "_inbox.>"')
    await agent_a.nc.subscribe("nodus.node.node-b.req.>")
    assert await agent_a.refused('subscription to "nodus.node.node-b.req.>"')


async def test_an_agent_cannot_send_another_nodes_requests_or_the_apis(
    agent_a: Confined,
) -> None:
    await agent_a.nc.publish("nodus.node.node-b.req.stop", b"{}")
    assert await agent_a.refused("nodus.node.node-b.req.stop")
    await agent_a.nc.publish(names.API_JOBS_APPLY, b"{}")
    assert await agent_a.refused(names.API_JOBS_APPLY)
    await agent_a.nc.publish("$JS.API.STREAM.DELETE.KV_nodus-jobs", b"")
    assert await agent_a.refused("$js.api.stream.delete.kv_nodus-jobs")


async def test_a_relay_writes_only_its_own_record(nats_server: NatsServer, bus: Bus) -> None:
    relay = await connect_confined(nats_server, nats_server.user("relay-x", RELAY, "relay-x"))
    try:
        js = relay.nc.jetstream(timeout=REFUSAL_WAIT)
        assert (await js.publish("$KV.nodus-relays.relay-x", b"{}")).seq > 0
        with pytest.raises(nats.errors.TimeoutError):
            await js.publish("$KV.nodus-relays.relay-y", b"{}")
        assert await relay.refused("$kv.nodus-relays.relay-y")
        with pytest.raises(nats.errors.TimeoutError):
            await relay.nc.request(
                "$JS.API.DIRECT.GET.KV_nodus-joinkeys.$KV.nodus-joinkeys.node-b.x.y.1",
                b"",
                timeout=REFUSAL_WAIT,
            )
        assert await relay.refused("kv_nodus-joinkeys")
    finally:
        await relay.nc.close()


async def test_the_cli_beside_nodus_up_finds_the_operators_key(
    nats_server: NatsServer, bus: Bus, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`nodus up` keeps the operator's seed in .nodus/nats/users/: a CLI run there needs no
    export (and without one, anywhere else, it says what to pass)."""
    from libs.client.client import LOCAL_OPERATOR, Client

    assert nats_server.credentials is not None
    monkeypatch.delenv("NODUS_CREDENTIALS")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(NodusError) as refused:
        await Client.connect(nats_server.url)
    assert refused.value.code is ErrorCode.UNAUTHORIZED
    LOCAL_OPERATOR.parent.mkdir(parents=True)
    shutil.copy(nats_server.credentials, LOCAL_OPERATOR)
    client = await Client.connect(nats_server.url)
    await client.close()


async def test_an_agent_answers_health_and_host_reboot_for_its_own_node_only(
    nats_server: NatsServer, bus: Bus, agent_a: Confined
) -> None:
    """R18 under S1: node-a's agent, on its own key, answers the remediator's health check and
    in-band reboot for node-a; it cannot take node-b's (a forged "healthy" for another machine)."""
    from libs.contracts.providers import HealthCheckReply, HealthCheckRequest
    from services.agent.agent import Agent
    from tests.factories import machine

    for verb in ("health", "host-reboot"):
        await agent_a.nc.subscribe(f"nodus.node.node-b.req.{verb}")
        assert await agent_a.refused(f'subscription to "nodus.node.node-b.req.{verb}"')
    seed = nats_server.user("agent-node-a", AGENT, "node-a")
    confined = await Bus.open(
        nats_server.url,
        credentials=seed,
        buckets=AGENT_BUCKETS,
        inbox_prefix=agent_inbox("node-a"),
        confined=True,
    )
    agent = Agent(confined, machine("node-a"), heartbeat_seconds=5)
    try:
        await agent.start()
        reply = await bus.request(
            names.node_request("node-a", names.AgentVerb.HEALTH),
            HealthCheckRequest(),
            HealthCheckReply,
        )
        assert reply.healthy and reply.node == "node-a" and reply.boot_id == agent.boot_id
    finally:
        await agent.stop()
        await confined.close()

"""The bus on a real nats-server: the journal is mandatory (C7), requests fail readably (C1),
compare-and-set writes, malformed records are counted and skipped (S3), the epoch guard (C2)."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import nats.errors
import pytest
from prometheus_client import REGISTRY

from libs.bus import Bus, Endpoint, EpochGuard, check_plan_generations
from libs.bus.connection import DRAIN_SECONDS
from libs.bus.server import NatsServer, free_port
from libs.contracts import names
from libs.contracts.api import NodeInfoReply, NodeInfoRequest
from libs.contracts.epochs import Lease
from libs.contracts.errors import ErrorCode, NodusError


@pytest.fixture
def plain_nats(tmp_path: Path) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path / "plain", jetstream=False).start()
    yield server
    server.stop()


async def test_a_service_refuses_to_start_without_jetstream(plain_nats: NatsServer) -> None:
    with pytest.raises(NodusError) as refused:
        await Bus.open(plain_nats.url, buckets=[names.BUCKET_JOBS])
    assert refused.value.code is ErrorCode.JOURNAL_UNAVAILABLE
    assert "nodus-jobs" in refused.value.message
    assert "JetStream" in refused.value.message


async def test_a_bus_that_is_down_is_a_clear_error() -> None:
    with pytest.raises(NodusError) as refused:
        await Bus.open(f"nats://127.0.0.1:{free_port()}", buckets=[names.BUCKET_JOBS])
    assert refused.value.code is ErrorCode.JOURNAL_UNAVAILABLE
    assert "cannot reach the bus" in refused.value.message


async def test_a_request_to_a_node_without_agent_is_an_error_to_the_sender(bus: Bus) -> None:
    with pytest.raises(NodusError) as refused:
        await bus.request(
            names.node_request("ghost-node", names.AgentVerb.INFO), NodeInfoRequest(), NodeInfoReply
        )
    assert refused.value.code is ErrorCode.NO_RESPONDERS
    assert "nodus.node.ghost-node.req.info" in refused.value.message


async def test_refusals_and_malformed_requests_come_back_with_codes(bus: Bus) -> None:
    async def refuse(_: NodeInfoRequest) -> NodeInfoReply:
        raise NodusError(ErrorCode.NOT_FOUND, "no such thing", field="$.x")

    await bus.serve(
        "test-svc", "1.0.0", "test", [Endpoint("info", "test.info", NodeInfoRequest, refuse)]
    )
    with pytest.raises(NodusError) as refused:
        await bus.request("test.info", NodeInfoRequest(), NodeInfoReply)
    assert (refused.value.code, refused.value.message, refused.value.field) == (
        ErrorCode.NOT_FOUND,
        "no such thing",
        "$.x",
    )
    msg = await bus.nc.request("test.info", b"{not json", timeout=2)
    assert msg.headers is not None
    assert msg.headers["Nats-Service-Error-Code"] == "Invalid"
    assert "malformed request" in msg.headers["Nats-Service-Error"]


async def test_services_answer_nats_discovery(bus: Bus) -> None:
    async def ok(_: NodeInfoRequest) -> NodeInfoRequest:
        return NodeInfoRequest()

    await bus.serve(
        "test-svc", "1.2.3", "test", [Endpoint("info", "test.info", NodeInfoRequest, ok)]
    )
    reply = await bus.nc.request("$SRV.INFO.test-svc", b"", timeout=2)
    assert b'"version":"1.2.3"' in reply.data.replace(b" ", b"")


async def test_compare_and_set_lets_one_writer_win(bus: Bus) -> None:
    leases = bus.bucket(names.BUCKET_LEASES, Lease)
    first = await leases.create("m1", Lease(gang="a.x", epoch=1, placer="p1"))
    second = await leases.create("m1", Lease(gang="b.y", epoch=1, placer="p2"))
    assert first is not None and second is None
    stale = await leases.update("m1", Lease(gang="c.z", epoch=1, placer="p3"), first - 1)
    assert stale is None
    assert (await leases.get("m1")).value.gang == "a.x"  # type: ignore[union-attr]
    moved = await leases.update("m1", Lease(gang="a.x", epoch=2, placer="p1"), first)
    assert moved is not None
    assert not await leases.delete("m1", first)  # a stale revision deletes nothing
    assert await leases.get("m1") is not None
    assert await leases.delete("m1", moved)
    assert await leases.get("m1") is None
    # A deleted key can be created again.
    assert await leases.create("m1", Lease(gang="d.w", epoch=1, placer="p4")) is not None


async def test_a_malformed_record_is_skipped_and_counted(bus: Bus) -> None:
    leases = bus.bucket(names.BUCKET_LEASES, Lease)
    await leases.put("good", Lease(gang="a.x", epoch=1, placer="p"))
    kv = await bus.js.key_value(names.BUCKET_LEASES)
    await kv.put("bad", b'{"gang": 7}')
    before = (
        REGISTRY.get_sample_value(
            "nodus_bus_malformed_records_total", {"bucket": names.BUCKET_LEASES}
        )
        or 0.0
    )
    snapshot = await leases.snapshot()
    assert set(snapshot) == {"good"}
    after = REGISTRY.get_sample_value(
        "nodus_bus_malformed_records_total", {"bucket": names.BUCKET_LEASES}
    )
    assert after == before + 1


def test_the_epoch_guard_refuses_stale_and_unpersisted_epochs() -> None:
    guard = EpochGuard()
    with pytest.raises(NodusError) as unknown:
        guard.check("acme.train", 1)
    assert unknown.value.code is ErrorCode.EPOCH_MISMATCH
    guard.advance("acme.train", 2)
    guard.advance("acme.train", 1)  # never moves back
    guard.check("acme.train", 2)
    with pytest.raises(NodusError) as stale:
        guard.check("acme.train", 1)
    assert stale.value.code is ErrorCode.STALE_EPOCH
    with pytest.raises(NodusError) as ahead:
        guard.check("acme.train", 3)
    assert ahead.value.code is ErrorCode.EPOCH_MISMATCH


def test_a_plan_whose_generations_disagree_is_refused() -> None:
    assert check_plan_generations("acme.train", [("epoch", 3), ("keys", 3), ("ranktable", 3)]) == 3
    with pytest.raises(NodusError) as refused:
        check_plan_generations("acme.train", [("epoch", 3), ("keys", 2)])
    assert "keys=2" in refused.value.message


async def test_closing_with_a_message_still_being_handled_is_bounded_and_logs_no_error(
    nats_server: NatsServer, caplog: pytest.LogCaptureFixture
) -> None:
    """A daemon that stops while a handler still runs (a request being answered at SIGTERM):
    close gives the drain its bound, then closes, and leaves no asyncio error behind (the
    agent-restart e2e test failed on one: '_GatheringFuture exception was never retrieved')."""
    bus = await Bus.open(nats_server.url, name="closing")
    handling = asyncio.Event()

    async def slow(_: object) -> None:
        handling.set()
        await asyncio.sleep(30)

    await bus.nc.subscribe("test.slow", cb=slow)
    await bus.nc.publish("test.slow", b"x")
    await asyncio.wait_for(handling.wait(), 5)
    started = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        await bus.close()
        took = time.monotonic() - started
        gc.collect()
        await asyncio.sleep(0.1)
    assert bus.nc.is_closed
    assert took < DRAIN_SECONDS + 2, took
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]


async def test_a_service_whose_first_flush_times_out_still_serves(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server failing over answers the flush of a starting service late: the service starts
    all the same (an agent restarted in chaos exited on it, seed 1)."""
    real_flush = bus.nc.flush
    late = [True, True]

    async def flush(timeout: int = 10) -> None:
        if late:
            late.pop()
            raise nats.errors.FlushTimeoutError
        await real_flush(timeout)

    monkeypatch.setattr(bus.nc, "flush", flush)

    async def refuse(_: NodeInfoRequest) -> NodeInfoReply:
        raise NodusError(ErrorCode.NOT_FOUND, "served")

    await bus.serve(
        "late-svc", "1.0.0", "test", [Endpoint("info", "late.info", NodeInfoRequest, refuse)]
    )
    with pytest.raises(NodusError, match="served"):
        await bus.request("late.info", NodeInfoRequest(), NodeInfoReply)

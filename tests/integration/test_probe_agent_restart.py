"""A probe pair whose agent restarts under it, or whose request a bus server lost on the way,
is measured again at once, not after its whole timeout (chaos seed 552850: an agent SIGKILLed
just after it took a probe-pair request, and the probe waited 115 s for the answer its process
took with it); a member whose agent stays silent is a lost member (the gang placed again
without it), not a failed path."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import msgspec
import pytest

from libs.bus import Bus
from libs.contracts import names
from libs.contracts.api import NodeInfoReply
from libs.contracts.base import encode
from libs.contracts.lifecycle import PairResult, ProbePairRequest, ProbeServeReply
from services.runner import agents
from services.runner.service import Runner
from tests.factories import machine, node_record


class FakeAgent:
    """One process of a node's agent, on the bus: it answers who it is, serves probes, and
    measures a pair unless told to take the request down with it."""

    def __init__(
        self, bus: Bus, node: str, answers_pairs: bool = True, loses_first_pair: bool = False
    ) -> None:
        self.bus = bus
        self.node = node
        self.instance = uuid.uuid4().hex
        self.answers_pairs = answers_pairs
        self.loses_first_pair = loses_first_pair  # a bus server drops it on the way here
        self.probing: set[str] = set()
        self.pairs_asked = 0
        self.pair_taken = asyncio.Event()
        self.subscriptions: list[Any] = []

    async def start(self) -> FakeAgent:
        record = node_record(machine(self.node))

        async def info(msg: Any) -> None:
            reply = NodeInfoReply(
                node=record, agent_instance=self.instance, probing=sorted(self.probing)
            )
            await msg.respond(encode(reply))

        async def serve(msg: Any) -> None:
            await msg.respond(encode(ProbeServeReply(address="198.18.9.1", port=5201)))

        async def pair(msg: Any) -> None:
            self.pairs_asked += 1
            if self.loses_first_pair and self.pairs_asked == 1:
                return  # never arrived: not held, never answered
            request = msgspec.json.decode(msg.data, type=ProbePairRequest)
            self.probing.add(names.probe_pair_key(request.gang, request.epoch, request.peer))
            self.pair_taken.set()
            if self.answers_pairs:
                result = PairResult(
                    a=self.node, b="peer", ok=True, tcp_gbps=1.0, path="direct", rtt_ms=1.0
                )
                await msg.respond(encode(result))

        for verb, handler in (
            (names.AgentVerb.INFO, info),
            (names.AgentVerb.PROBE_SERVE, serve),
            (names.AgentVerb.PROBE_PAIR, pair),
        ):
            subject = names.node_request(self.node, verb)
            self.subscriptions.append(await self.bus.nc.subscribe(subject, cb=handler))
        return self

    async def kill(self) -> None:
        for subscription in self.subscriptions:
            await subscription.unsubscribe()


async def test_a_pair_whose_agent_restarted_under_it_is_measured_again_at_once(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(agents, "RESTART_CHECK_SECONDS", 0.5)
    await FakeAgent(bus, "a").start()
    doomed = await FakeAgent(bus, "b", answers_pairs=False).start()  # dies holding the request
    runner = Runner(bus, "runner-test", readiness_seconds=30.0)
    loop = asyncio.get_running_loop()
    started = loop.time()
    measuring = asyncio.create_task(runner._pair("acme.restart", 1, "a", "b"))
    await asyncio.wait_for(doomed.pair_taken.wait(), 10)
    await doomed.kill()
    await asyncio.sleep(1.0)  # the machine's agent starts again
    await FakeAgent(bus, "b").start()
    result = await asyncio.wait_for(measuring, 30)
    assert result.ok, result
    assert loop.time() - started < 30  # not the 85-s timeout of the lost request


async def test_a_member_whose_agent_stays_silent_during_a_pair_is_lost(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(agents, "RESTART_CHECK_SECONDS", 0.5)
    monkeypatch.setattr(agents, "UNANSWERED_SECONDS", 1.5)
    await FakeAgent(bus, "a").start()
    doomed = await FakeAgent(bus, "b", answers_pairs=False).start()
    runner = Runner(bus, "runner-test", readiness_seconds=30.0)
    measuring = asyncio.create_task(runner._pair("acme.silent", 1, "a", "b"))
    await asyncio.wait_for(doomed.pair_taken.wait(), 10)
    await doomed.kill()  # and nothing comes back
    with pytest.raises(agents.MemberSilent, match="b: no agent answered the info"):
        await asyncio.wait_for(measuring, 30)


async def test_a_pair_whose_request_was_lost_on_the_way_is_measured_again_at_once(
    bus: Bus, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(agents, "RESTART_CHECK_SECONDS", 0.5)
    await FakeAgent(bus, "a").start()
    b = await FakeAgent(bus, "b", loses_first_pair=True).start()
    runner = Runner(bus, "runner-test", readiness_seconds=30.0)
    loop = asyncio.get_running_loop()
    started = loop.time()
    result = await asyncio.wait_for(runner._pair("acme.lost", 1, "a", "b"), 30)
    assert result.ok, result
    assert b.pairs_asked == 2  # asked again, by the same agent process
    assert loop.time() - started < 30  # not the 85-s timeout of the lost request

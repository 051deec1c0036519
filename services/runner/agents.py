"""Asking a member's agent for something the run needs (a launch, the shim's self-test, a probe), the
way the platform's losses are told from the workload's: a request nobody answers (no agent
subscribed: one restarting) or whose answer is lost (a server of the bus failing over between
the agent and the runner) is asked again, since every such request is safe to repeat (the agent
launches a rank once, and runs a self-test again harmlessly). An agent that stays silent past
the deadline is a lost member, and the gang is placed again without it; it is never the
workload's failure."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import NoReturn, TypeVar

import msgspec

from libs.bus import Bus
from libs.contracts import names
from libs.contracts.api import NodeInfoReply, NodeInfoRequest
from libs.contracts.errors import ErrorCode, NodusError

log = logging.getLogger("nodus.runner")

R = TypeVar("R", bound=msgspec.Struct)

# An agent restarts in seconds (O4); a bus server fails over in a few more.
UNANSWERED_SECONDS = 30.0
# How often an agent busy with a long request (a probe's sample) is asked whether it is the
# process that received it.
RESTART_CHECK_SECONDS = 3.0
_UNANSWERED = (ErrorCode.NO_RESPONDERS, ErrorCode.TIMEOUT)


class MemberSilent(Exception):
    """The member's agent answered nothing until the deadline: the platform lost it."""

    def __init__(self, node: str, verb: names.AgentVerb, last: NodusError) -> None:
        super().__init__(f"{node}: no agent answered the {verb.value} in time ({last.message})")
        self.node = node


async def ask(
    bus: Bus,
    node: str,
    verb: names.AgentVerb,
    body: msgspec.Struct,
    reply: type[R],
    each: float,
    unanswered: float | None = None,
) -> R:
    """`verb` asked of `node`'s agent, each try bounded by `each` seconds, again while it goes
    unanswered; MemberSilent after `unanswered` seconds of that. Any other error (the agent
    answered with a refusal) is raised as it is."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + (UNANSWERED_SECONDS if unanswered is None else unanswered)
    subject = names.node_request(node, verb)
    while True:
        left = max(deadline - loop.time(), 0.0)
        try:
            return await bus.request(subject, body, reply, min(each, max(left, 1.0)), left)
        except NodusError as error:
            if error.code not in _UNANSWERED:
                raise
            if loop.time() >= deadline:
                raise MemberSilent(node, verb, error) from error
            log.info("%s: %s; asking again", node, error.message)


class RequestLost(Exception):
    """A long request an agent should hold, lost: its agent's process changed (the request
    went with the old one), or the agent does not hold it (lost on the way there)."""

    def __init__(self, node: str, why: str) -> None:
        super().__init__(f"{node}: {why}")
        self.node = node


async def _infos(
    bus: Bus, nodes: list[str], unanswered: float | None = None
) -> dict[str, NodeInfoReply]:
    """Each node's agent as it answers now (MemberSilent for one that answers none)."""
    replies = await asyncio.gather(
        *(
            ask(
                bus,
                node,
                names.AgentVerb.INFO,
                NodeInfoRequest(),
                NodeInfoReply,
                each=5,
                unanswered=unanswered,
            )
            for node in nodes
        )
    )
    return dict(zip(nodes, replies, strict=True))


async def instances(bus: Bus, nodes: list[str], unanswered: float | None = None) -> dict[str, str]:
    """Which process of its agent each node runs now (MemberSilent for one that answers none
    within `unanswered` seconds, by default a member's patience)."""
    infos = await _infos(bus, nodes, unanswered)
    return {node: info.agent_instance for node, info in infos.items()}


async def unless_lost(
    bus: Bus, held: dict[str, str], work: Awaitable[R], holding: dict[str, str] | None = None
) -> R:
    """`work`, a long request to the agents in `held` (node -> the process it runs), unless
    one of them restarts, or does not hold the probe pair `holding` names for it twice in a row
    (RequestLost), or goes silent (MemberSilent) first. Without this, a probe pair whose agent
    was killed as it began (chaos seed 552850), or whose request a bus server lost on the way,
    waited its whole timeout (85-115 s)."""
    working = asyncio.ensure_future(work)
    checking = asyncio.ensure_future(_until_lost(bus, held, holding or {}))
    try:
        await asyncio.wait({working, checking}, return_when=asyncio.FIRST_COMPLETED)
        if working.done():
            return working.result()
        return checking.result()  # raises what ended the check
    finally:
        for task in (working, checking):
            task.cancel()
        await asyncio.gather(working, checking, return_exceptions=True)


async def _until_lost(bus: Bus, held: dict[str, str], holding: dict[str, str]) -> NoReturn:
    nodes = sorted(held)
    missing: dict[str, int] = {}
    while True:
        await asyncio.sleep(RESTART_CHECK_SECONDS)
        infos = await _infos(bus, nodes)
        for node in nodes:
            if infos[node].agent_instance != held[node]:
                raise RequestLost(node, "its agent restarted")
            if node in holding and holding[node] not in infos[node].probing:
                # Twice: once may be the moment its answer is on the way back.
                missing[node] = missing.get(node, 0) + 1
                if missing[node] >= 2:
                    raise RequestLost(node, "its agent does not hold the request (lost on the way)")
            else:
                missing.pop(node, None)

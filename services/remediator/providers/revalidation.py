"""Revalidation on the machine itself (R15, R18): the machine's monitor runs every detector
from scratch over its own inputs, and its agent runs its own checks; each must answer from the
machine, and a request nobody answers is a failure (a machine that cannot say it is healthy
does not rejoin)."""

from __future__ import annotations

from libs.bus import Bus
from libs.contracts import names
from libs.contracts.errors import NodusError
from libs.contracts.providers import HealthCheckReply, HealthCheckRequest

# Who answers each request: the agent for `health`, the machine's monitor for `diagnose`.


async def on_machine(bus: Bus, node: str, op_id: str = "", timeout: float = 30.0) -> list[str]:
    """The failures; empty when the machine's monitor and agent both say it is healthy."""
    failures: list[str] = []
    for verb, who in ((names.AgentVerb.DIAGNOSE, "monitor"), (names.AgentVerb.HEALTH, "agent")):
        try:
            reply = await bus.request(
                names.node_request(node, verb),
                HealthCheckRequest(op_id=op_id),
                HealthCheckReply,
                timeout=timeout,
            )
        except NodusError as error:
            failures.append(f"{who}: {node}'s {who} does not answer its {verb} request: {error}")
            continue
        failures += reply.failures
    return failures

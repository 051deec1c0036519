"""What S1 costs: an agent's bus work on a nats-server without authentication (the baseline,
as the bus ran before) and on one with it (NKey users, the agent confined by permissions),
in the same run, rounds interleaved so both see the same machine.

Per round and server: connecting (NKey signs the server's nonce), KV puts of the agent's own
key (the heartbeat), gets by key (direct reads, which confinement needs), a watch's first
value (a named consumer), a snapshot of its own key (whether any key matches is asked by a
direct read of the last of its keys when confined, of the stream otherwise), and
request/reply to the agent's node subject.

    python -m tests.bench.bus_auth [--rounds N] [--ops N] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from libs.bus import Bus
from libs.bus.auth import AGENT, agent_inbox
from libs.bus.server import NatsServer
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.fleet import NodeHealth
from tests.bench.running import (
    add_run_flags,
    bench_main,
    bench_parser,
    machine_facts,
    progress,
    run_bench,
)

log = progress("bus_auth")
NODE = "bench-node"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = bench_parser("bus_auth", __doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--ops", type=int, default=500, help="puts, gets and requests per round")
    add_run_flags(parser, budget=300, quick="2 rounds of 100")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.ops = 2, 100
    return args


async def _round(
    server: NatsServer, seed: str | None, operator: str | None, ops: int
) -> dict[str, float]:
    t0 = time.perf_counter()
    agent = await Bus.open(
        server.url,
        name="bench-agent",
        credentials=seed,
        buckets=[names.BUCKET_HEALTH],
        inbox_prefix=agent_inbox(NODE) if seed else None,
        confined=bool(seed),
    )
    connect_ms = (time.perf_counter() - t0) * 1000
    try:
        health = agent.bucket(names.BUCKET_HEALTH, NodeHealth)
        beat = NodeHealth(node=NODE, healthy=True, heartbeat_time=now(), boot_id="b")
        t0 = time.perf_counter()
        for _ in range(ops):
            await health.put(NODE, beat)
        put_us = (time.perf_counter() - t0) / ops * 1e6
        t0 = time.perf_counter()
        for _ in range(ops):
            await health.get(NODE)
        get_us = (time.perf_counter() - t0) / ops * 1e6
        t0 = time.perf_counter()
        async for _change in health.watch(NODE):
            break
        watch_ms = (time.perf_counter() - t0) * 1000
        # A snapshot asks first whether any key matches: the stream (unconfined), or a consumer
        # of the agent's own keys (confined: the stream's answer may list every key's name).
        snapshots = max(10, ops // 10)
        t0 = time.perf_counter()
        for _ in range(snapshots):
            assert NODE in await health.snapshot(NODE)
        snapshot_ms = (time.perf_counter() - t0) / snapshots * 1000
        subject = names.node_request(
            NODE, names.AgentVerb.INFO
        )  # echoed by the bench, not an agent

        async def echo(msg: Any) -> None:
            await msg.respond(msg.data)

        await agent.nc.subscribe(subject, cb=echo)
        await agent.nc.flush()
        # The control plane asks the agent (it answers as a reply: allow_responses).
        asker = await Bus.open(server.url, name="bench-asker", credentials=operator)
        try:
            t0 = time.perf_counter()
            for _ in range(ops):
                await asker.nc.request(subject, b"x", timeout=5)
            request_us = (time.perf_counter() - t0) / ops * 1e6
        finally:
            await asker.close()
    finally:
        await agent.close()
    return {
        "connect_ms": connect_ms,
        "kv_put_us": put_us,
        "kv_get_us": get_us,
        "watch_first_value_ms": watch_ms,
        "snapshot_ms": snapshot_ms,
        "request_us": request_us,
    }


async def _body(state: Path, args: argparse.Namespace) -> dict[str, Any]:
    open_bus = NatsServer(state / "open", auth=False).start()
    confined = NatsServer(state / "confined").start()
    try:
        for server, creds in ((open_bus, None), (confined, confined.credentials)):
            control = await Bus.open(
                server.url, credentials=creds, buckets=[names.BUCKET_HEALTH], streams=True
            )
            await control.close()
        seed = confined.user(f"agent-{NODE}", AGENT, NODE)
        samples: dict[str, list[dict[str, float]]] = {"no_auth": [], "nkey_confined": []}
        for index in range(args.rounds):
            samples["no_auth"].append(await _round(open_bus, None, None, args.ops))
            samples["nkey_confined"].append(
                await _round(confined, seed, confined.credentials, args.ops)
            )
            log(f"round {index + 1}/{args.rounds}")
        figures = {
            kind: {key: round(statistics.median(s[key] for s in rounds), 1) for key in rounds[0]}
            for kind, rounds in samples.items()
        }
        ratio = {
            key: round(figures["nkey_confined"][key] / figures["no_auth"][key], 2)
            for key in figures["no_auth"]
        }
        return {
            "params": {"rounds": args.rounds, "ops": args.ops},
            "machine": machine_facts(),
            "median": figures,
            "confined_over_baseline": ratio,
        }
    finally:
        open_bus.stop()
        confined.stop()


def run(args: argparse.Namespace) -> dict[str, Any]:
    return run_bench("nodus-bench-bus-auth-", lambda state: _body(state, args), args, lambda: None)


def main(argv: list[str] | None = None) -> int:
    return bench_main(run, parse_args(argv), lambda: None)


if __name__ == "__main__":
    sys.exit(main())

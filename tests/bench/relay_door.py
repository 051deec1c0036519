"""What a shared port costs a member's connection to its relay: the time from connect() to the
relay's Welcome, through the relay's own port (the baseline) and through the port it shares
with the other relays of its host (443 in production), in the same run, rounds interleaved.

What runs: a real nats-server with authentication; two `nodus relay` processes, each with its
own bus user, port and key, sharing one more port (`--share-port`); this process as the members
(one gang epoch enrolled on the bus). Each connect is a new TCP connection and a whole
handshake (challenge, hello, the relay's membership check, welcome), then closed. Through the
shared port the kernel gives the connection to either relay: about half reach the member's
relay first (`shared_direct`), the others are handed to it by its sibling (`shared_handed`:
the Route frame, the descriptor passed between the processes, a second challenge).

    python -m tests.bench.relay_door [--rounds N] [--connects N] [--quick]

Speed is reported, never asserted; stdout carries one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from libs.bus import Bus
from libs.bus.auth import RELAY
from libs.bus.server import NatsServer, free_port
from libs.contracts import names
from libs.contracts.relay import RelayRecord, member_door
from libs.relayproto.client import RelayClient
from tests.bench.running import (
    add_run_flags,
    bench_main,
    bench_parser,
    machine_facts,
    progress,
    run_bench,
)
from tests.integration.conftest import Node, enrol
from tests.relay_processes import nodus_relay

log = progress("relay_door")
RELAYS = ("door-a", "door-b")
GANG = "bench.door"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = bench_parser("relay_door", __doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--connects", type=int, default=200, help="per round and way")
    add_run_flags(parser, budget=300, quick="2 rounds of 40")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.connects = 2, 40
    return args


async def _connect_ms(node: Node, door: tuple[str, str, bytes | None]) -> tuple[float, bool]:
    """One whole connection to the relay: (ms to its Welcome, whether it was handed on)."""
    client: RelayClient = node.dial(door)
    started = time.perf_counter()
    await client.connect()
    took = (time.perf_counter() - started) * 1000
    assert client.conn is not None and client.welcomed_by == door[0], client.welcomed_by
    routed = client.conn.routed
    client.conn.close()
    return took, routed


async def _doors(bus: Bus, processes: list[subprocess.Popen[bytes]]) -> dict[str, Any]:
    records = bus.bucket(names.BUCKET_RELAYS, RelayRecord)
    for _ in range(300):
        for process in processes:
            if process.poll() is not None:
                raise RuntimeError(f"a relay exited: {process.communicate()[1].decode()[-400:]}")
        found = {name: await records.get(name) for name in RELAYS}
        if all(f is not None and f.value.shared_address for f in found.values()):
            return {name: f.value for name, f in found.items() if f is not None}
        await asyncio.sleep(0.1)
    raise RuntimeError("the relays never announced their shared port")


def _figures(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "n": len(ordered),
        "p50_ms": round(statistics.median(ordered), 3),
        "p90_ms": round(ordered[int(0.9 * (len(ordered) - 1))], 3),
        "p99_ms": round(ordered[int(0.99 * (len(ordered) - 1))], 3),
    }


async def _body(state: Path, args: argparse.Namespace) -> dict[str, Any]:
    server = NatsServer(state / "bus").start()
    processes: list[subprocess.Popen[bytes]] = []
    try:
        bus = await Bus.open(
            server.url,
            credentials=server.credentials,
            buckets=[names.BUCKET_RELAYS, names.BUCKET_MEMBERS, names.BUCKET_EPOCHS],
            streams=True,
        )
        shared = free_port()
        processes = [
            nodus_relay(
                server,
                state,
                name,
                server.user(name, RELAY, name),
                *("--share-port", str(shared), "--log-level", "WARNING"),
            )
            for name in RELAYS
        ]
        records = await _doors(bus, processes)
        member = Node(GANG, 1, "m")
        await enrol(bus, GANG, 1, [member])
        target = records[RELAYS[1]]
        ways = {
            "own_port": (target.name, target.address, None),
            "shared_port": member_door(target),
        }
        for _ in range(100):  # the relays learn the member from the bus
            try:
                await _connect_ms(member, ways["own_port"])
                break
            except Exception:
                await asyncio.sleep(0.1)
        samples: dict[str, list[float]] = {"own_port": [], "shared_direct": [], "shared_handed": []}
        for index in range(args.rounds):
            order = list(ways.items())
            if index % 2:
                order.reverse()
            for way, door in order:
                for _ in range(args.connects):
                    took, routed = await _connect_ms(member, door)
                    if way == "own_port":
                        samples[way].append(took)
                    else:
                        samples["shared_handed" if routed else "shared_direct"].append(took)
            log(f"round {index + 1}/{args.rounds}")
        await bus.close()
        figures = {way: _figures(s) for way, s in samples.items() if s}
        base = figures["own_port"]["p50_ms"]
        return {
            "params": {"rounds": args.rounds, "connects": args.connects},
            "machine": machine_facts(),
            "connect_to_welcome": figures,
            "p50_over_own_port": {
                way: round(f["p50_ms"] / base, 2) for way, f in figures.items() if way != "own_port"
            },
        }
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        server.stop()


def run(args: argparse.Namespace) -> dict[str, Any]:
    return run_bench(
        "nodus-bench-relay-door-", lambda state: _body(state, args), args, lambda: None
    )


def main(argv: list[str] | None = None) -> int:
    return bench_main(run, parse_args(argv), lambda: None)


if __name__ == "__main__":
    sys.exit(main())

"""Slow-receiver bench: does a member that stops reading slow any OTHER gang on the same relays?

    .venv/bin/python -m tests.bench.slow_receiver            # about 80 s
    .venv/bin/python -m tests.bench.slow_receiver --quick    # about 25 s (smoke)

What runs, in this one process on a real nats-server (no agents, no WireGuard): two meshed
`Relay`s (services/relay/relay.py) on 127.0.0.1 and four `RelayClient`s (the member's client:
libs/relayproto/client.py, services/agent/relayclient.py before issue 9) as members, with the
membership records the relays read (epoch and member records in KV, as the placer and the
agents write them). The homes force every byte across the one mesh link relay-0 -> relay-1:

    gang 1   A1 on relay-0 only  ->  B1 on relay-1 only  (B1 through a local pipe that can stall)
    gang 2   A2 on relay-0 only  ->  B2 on relay-1 only  (the gang whose goodput is measured)

Each sender streams WireGuard-shaped transport messages (type 4, a 16-byte header whose
counter is the message's sequence number, a MESSAGE-byte body, a 16-byte tag: what the relay
forwards, see libs/wg message_type) as fast as its relay connection takes them (it waits on
the connection's write buffer above 1 MiB). Gang 2 streams throughout; the phases are

    alone           gang 1 idle
    shared          A1 streams to B1 too, B1 reading: the unstalled figure
    slow            B1 reads only TRICKLE bytes/s of what relay-1 sends it (a receiver that
                    falls behind but still hears its relay); A1 keeps sending to it
    recovered_slow  B1 reads at full speed again
    stalled         B1 stops reading (its pipe stops reading the relay's socket, so relay-1
                    sees a member whose TCP window closes); A1 keeps sending to it
    recovered       B1 reads again (and rejoins relay-1 if its connection ended meanwhile: a
                    client that hears nothing from its relay may give up on it)

Per phase, over the phase minus its first SETTLE seconds: each gang's goodput at its receiver
(Mbit/s of WireGuard messages delivered), gang 2's longest interval without a delivery, gang
2's goodput in every half second of the whole phase (when a stall bites, when it recovers),
this process's CPU and the machine's, with how busy other programs kept it
(`others_busy_cores`: figures from a shared machine are only comparable when it is near 0),
and how the relays' counters (nodus_relay_*_total, drops by reason included) moved. Over the
run: lost or reordered messages per gang (sequence numbers), the time from each resume to
gang 2's next delivery, every member connection that ended (in which phase, and why when the
client says), and the warnings and errors logged in this process (relays, clients, asyncio).

Two configurations, each on fresh relays and fresh gangs: `capped`, the relays as deployed,
holding each member to its share (derive(RELAYED, 2).relay_member_bits_per_second), and
`uncapped` (rate_limit=False: what the process can push; the gangs then share its CPU, so
`shared` is below `alone`). `summary` carries the ratios: `stalled_over_unstalled` is gang 2's
goodput while B1 is stalled over its goodput with both gangs streaming and B1 reading (1.0:
no harm; near 0: head-of-line blocking on the mesh link), `slow_over_unstalled` the same for
the slow receiver, `recovered_over_unstalled` whether it comes back.

Speed is reported, never asserted; stdout carries one JSON object, progress goes to stderr.
Exit status 1 means the run did not complete (setup failed, the budget ran out), not that a
gang was slow. Everything it starts (nats-server, relays, clients, pipes) is stopped when it
ends, however it ends; `--keep-state` keeps nats-server's directory.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from libs.bus import Bus
from libs.bus.server import NatsServer
from libs.contracts import names
from tests.bench.running import add_run_flags, bench_main, bench_parser, machine_facts, run_bench
from tests.bench.slow_receiver_experiment import PHASES, Experiment, LogTally


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = bench_parser("slow_receiver", __doc__)
    parser.add_argument("--phase", type=float, default=5.0, help="seconds of each phase")
    parser.add_argument(
        "--settle", type=float, default=1.0, help="seconds at the start of a phase not measured"
    )
    parser.add_argument(
        "--message",
        type=int,
        default=32 << 10,
        help="bytes of each message's body (the link's chunk)",
    )
    parser.add_argument(
        "--trickle",
        type=float,
        default=64 << 10,
        help="bytes/s the slow receiver reads in the `slow` phase",
    )
    parser.add_argument(
        "--configs",
        default="capped,uncapped",
        help="comma-separated: capped (relays as deployed), uncapped (rate_limit=False)",
    )
    add_run_flags(parser, 300.0, "1.5 s phases (smoke)", keep="nats-server's directory")
    args = parser.parse_args(argv)
    if args.quick:
        args.phase, args.settle, args.budget = 1.5, 0.5, 120.0
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = set(args.configs) - {"capped", "uncapped"}
    if unknown or not args.configs:
        parser.error(f"unknown configs: {sorted(unknown)}")
    if args.message % 16 or args.message < 16:
        parser.error("--message must be a positive multiple of 16 (WireGuard pads to 16)")
    return args


async def run_async(args: argparse.Namespace, state: Path) -> dict[str, Any]:
    result: dict[str, Any] = {
        "params": {
            "phase_seconds": args.phase,
            "settle_seconds": args.settle,
            "message_body_bytes": args.message,
            "slow_receiver_bytes_s": args.trickle,
            "configs": args.configs,
            "phases": list(PHASES),
        },
        "machine": machine_facts(),
        "topology": {
            "gang1": "A1 on relay-0 -> B1 on relay-1 (B1 stalls)",
            "gang2": "A2 on relay-0 -> B2 on relay-1 (measured)",
            "mesh": "every byte crosses the relay-0 -> relay-1 link",
        },
        "configs": {},
    }
    tally = LogTally()
    logging.getLogger().addHandler(tally)
    nats = NatsServer(state / "nats")
    _servers.append(nats)
    bus: Bus | None = None
    experiment: Experiment | None = None
    try:
        nats.start()
        # Authentication is on: this bench and the processes it starts are the bus's operator.
        os.environ["NODUS_CREDENTIALS"] = nats.credentials or ""
        bus = await Bus.open(nats.url, name="bench", buckets=names.ALL_BUCKETS, streams=True)
        experiment = Experiment(args, bus, nats)
        for config in args.configs:
            result["configs"][config] = await experiment.run(config, tally)
    finally:
        if experiment is not None:
            await experiment.close()
        if bus is not None:
            await bus.close()
        nats.stop()
        logging.getLogger().removeHandler(tally)
        result["machine"]["loadavg_at_end"] = os.getloadavg()
    result["summary"] = {
        config: {
            **c["ratios"],
            "gang2_mbit_s": {p: c["phases"][p]["gang2_mbit_s"] for p in PHASES},
            "gang2_lost_messages": c["flows"]["gang2"]["lost_messages"],
            "connections_ended": c["connections_ended"],
            "others_busy_cores_max": max(c["phases"][p]["others_busy_cores"] for p in PHASES),
        }
        for config, c in result["configs"].items()
    }
    return result


_servers: list[NatsServer] = []


def cleanup() -> None:
    """Stop the nats-server this bench started, however the run ended; safe to call twice."""
    while _servers:
        _servers.pop().stop()


def run(args: argparse.Namespace) -> dict[str, Any]:
    return run_bench("nodus-bench-slow-", lambda state: run_async(args, state), args, cleanup)


def main(argv: Sequence[str] | None = None) -> int:
    return bench_main(run, parse_args(argv), cleanup)


if __name__ == "__main__":
    sys.exit(main())

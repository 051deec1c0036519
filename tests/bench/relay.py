"""Relayed-path benchmark: goodput, CPU per Gbit, failover and fairness, with real processes.

    .venv/bin/python -m tests.bench.relay            # about 3 minutes
    .venv/bin/python -m tests.bench.relay --quick    # about 1 minute (smoke)

What runs (all real processes, `LocalSystem`: nats-server, the placer, the runner, two meshed
relays, one agent per fleet machine), in two systems, one after the other, in the same run.
Each job runs `sleep` as its ranks, and nothing is measured before every job is past the
runner's own probe (a short throughput sample through the same tunnels, reported as `gang`).

  cap off   a 2-machine fleet (container A, VM B, transport Auto -> Relayed), relays started
            with `--no-rate-limit`. One-way streams A -> B over four paths, in interleaved
            rounds whose order rotates:
              direct       a TCP connection from A's address straight to B's (the ceiling)
              socat        through one `socat TCP-LISTEN:..,fork,reuseaddr TCP:..` (a plain relay)
              socat_chain  through as many socat hops as the Relayed path has processes
                           (the 2 members' dataplanes + the relays that carried a short
                           A -> B stream, measured from their written bytes: a relay
                           delivers straight to a member connected to it, so usually one)
              sealed_chain the same hops, the first sealing with ChaCha20-Poly1305 (TLS 1.2,
                           WireGuard's AEAD) and the last opening: the same cryptography as
                           the Relayed path, so its ratio is the Relayed path's own overhead
              relayed      through agent A's SOCKS5 entry, the relays, agent B's tunnel
            Goodput (Mbit/s), CPU seconds per Gbit of the processes that carry the bytes
            (socat processes and their forked children; both agents, the dataplanes they
            run the tunnels in, and both relays), and
            this harness's own CPU per Gbit. Then both ways at once through the relays.
  cap on    16 machines: 8 containers + 8 VMs, each container/VM pair with an accelerator
            model only that pair has, so the 8 jobs (`members: 2`, `transport: Auto`) land on
            8 container+VM pairs, all Relayed. The relays hold each member to
            `derive(RELAYED, 2).relay_member_bits_per_second` (libs/contracts/bounds.py).
              one_gang     gang 0 alone: A -> B alone, B -> A alone, both at once, each against
                           its share (`over_share`)
              gangs        every gang streams both ways at once: aggregate goodput, per-gang
                           goodput, Jain's fairness index and min/max over the gangs, which
                           relays each gang's members are homed on and each relay's CPU
                           (`--relays N`: N relays instead of 2; each gang gets two of them)
              failover     gang 0 streams both ways; the relay member A is homed on is SIGKILLed
                           mid-stream: the longest interval with no byte delivered at each
                           receiver around the kill (and the longest before it, for scale), and
                           the time from the kill until each agent's `epochs` reply names the
                           other relay (polled every POLL seconds). The relay is started again
                           at once: the time until its members are homed on it again (they
                           wait RETURN_HOME_SECONDS of it up) and the longest gap around that
                           move, still under the stream
              rescue       with `--relays 3` or more: gang 0 streams both ways and both of its
                           relays are SIGKILLed at once and left down (their host lost): the
                           time until each agent's `epochs` reply names a third relay (they
                           wait RESCUE_SECONDS with no relay up), the longest gap, and the bill
                           (the killed relays are started again after the stream, so that
                           what they metered is published)

Every stream is a deterministic 16 MiB pattern behind an 8-byte flow id; the receiver checks
every byte in order and counts them against what was sent (`intact`). Goodput is measured at
the receiver over a steady window (after a warm-up, until the senders stop); CPU is read from
/proc over the same window, with how busy the whole machine was and how much of that was
other programs (`others_busy_cores`: figures from a shared machine are only comparable when
it is near 0). `longest_gap_ms` is the longest interval with no byte delivered inside the
window (stalls). Through the relays, `billed_over_delivered` is what the relays metered for
the gang (the usage stream, G17: WireGuard messages members sent, acknowledgements and any
resend included) over the bytes delivered. While streaming, the harness runs at a higher
priority (nice HARNESS_NICE, when root) so the load generator is not what runs out of CPU.

Speed is reported, never asserted; stdout carries one JSON object, progress goes to stderr.
Exit status 1 means the run did not complete (a path failed, bytes were lost or corrupted,
the time budget ran out), not that it was slow. Every process the bench starts is stopped
when it ends, however it ends (and whatever the daemons started, ranks included);
`--keep-state` (or an error) keeps the state dir with the daemons' logs.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from libs.contracts.bounds import derive
from libs.contracts.jobs import PathClass
from tests.bench.relay_scenarios import POLL, cap_off, cap_on
from tests.bench.relay_streams import HARNESS_NICE, all_intact, can_renice
from tests.bench.relay_system import Bench, cleanup
from tests.bench.running import add_run_flags, bench_main, bench_parser, machine_facts, run_bench


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = bench_parser("relay", __doc__)
    parser.add_argument("--seconds", type=float, default=6.0, help="length of each stream")
    parser.add_argument("--warmup", type=float, default=1.0, help="seconds before the window")
    parser.add_argument("--rounds", type=int, default=3, help="cap-off rounds of every path")
    parser.add_argument("--gangs", type=int, default=8, help="gangs of the cap-on system")
    parser.add_argument(
        "--relays",
        type=int,
        default=2,
        help="relays of the cap-on system, meshed (each gang gets the least loaded two)",
    )
    parser.add_argument(
        "--kill-at", type=float, default=4.0, help="failover: seconds into the stream"
    )
    parser.add_argument(
        "--failover-seconds",
        type=float,
        default=16.0,
        help="failover: length of the stream (long enough for the members' return home)",
    )
    parser.add_argument(
        "--only",
        choices=("cap-off", "cap-on"),
        help="run one of the two systems (a partial run: it reports but never completes)",
    )
    add_run_flags(parser, 900.0, "2 s streams, 1 round (smoke)")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.warmup, args.rounds = 2.0, 0.5, 1
        args.kill_at, args.failover_seconds, args.budget = 1.5, 4.0, 420.0
    return args


def completed(result: dict[str, Any], only: str | None = None) -> bool:
    """Every part asked for (`--only`: one half) ran and every byte arrived intact."""
    if "error" in result:
        return False
    checks: list[bool | None] = []
    if only != "cap-on":
        off = result.get("cap_off", {})
        checks += [
            off.get(p, {}).get("intact")
            for p in ("direct", "socat", "socat_chain", "sealed_chain", "relayed")
        ]
        checks.append(all_intact(off["relayed_both_ways"]) if "relayed_both_ways" in off else None)
    if only != "cap-off":
        on = result.get("cap_on", {})
        one = on.get("one_gang", {})
        checks += [
            all_intact(one[k]) if k in one else None
            for k in ("a_to_b_alone", "b_to_a_alone", "both_at_once")
        ]
        checks += [on.get("gangs", {}).get("intact"), on.get("failover", {}).get("intact")]
        if "rescue" in on:
            checks.append(on["rescue"].get("intact"))
    return all(c is True for c in checks)


async def run_async(args: argparse.Namespace, state: Path) -> dict[str, Any]:
    bounds = derive(PathClass.RELAYED, 2)
    result: dict[str, Any] = {
        "params": {
            "stream_seconds": args.seconds,
            "warmup_seconds": args.warmup,
            "cap_off_rounds": args.rounds,
            "gangs": args.gangs,
            "relays": args.relays,
            "failover_stream_seconds": args.failover_seconds,
            "kill_at_seconds": args.kill_at,
            "epochs_poll_seconds": POLL,
        },
        "machine": machine_facts(socat=(shutil.which("socat") or "missing")),
        "bounds": {
            "gang_mbit_s": bounds.relay_gang_bits_per_second / 1e6,
            "member_mbit_s": bounds.relay_member_bits_per_second / 1e6,
            "tunnel_buffer_bytes": bounds.tunnel_buffer_bytes,
        },
    }
    bench = Bench(args, state)
    try:
        if args.only != "cap-on":
            result["cap_off"] = await cap_off(bench)
        if args.only != "cap-off":
            result["cap_on"] = await cap_on(bench)
    finally:
        await bench.down()
        result["machine"]["loadavg_at_end"] = os.getloadavg()
    return result


# The relayed path's cap-off goodput over a chain of as many socat hops doing the same
# cryptography (sealed chain), measured in the same run: a timing is noise on these machines, a
# ratio below this is a regression (issue 23). Against the plain chain, which seals nothing,
# the ratio depends on how fast the machine's ChaCha20-Poly1305 is (0.48 to 1.0 seen).
GUARD_RELAYED_OVER_SEALED_CHAIN = 0.5


def guard(result: dict[str, Any]) -> str | None:
    """Why the run's figures fall below their guard, or None."""
    ratio = result.get("cap_off", {}).get("ratios", {}).get("relayed_over_sealed_chain")
    if ratio is None:
        return "no relayed-over-sealed-chain ratio was measured"
    if ratio < GUARD_RELAYED_OVER_SEALED_CHAIN:
        return (
            f"guard relayed_over_sealed_chain: {ratio} is below "
            f"{GUARD_RELAYED_OVER_SEALED_CHAIN} (cap off, the same run's socat chain of as many "
            "hops, sealing with ChaCha20-Poly1305 at its first and opening at its last)"
        )
    return None


async def measured(args: argparse.Namespace, state: Path) -> dict[str, Any]:
    """The run, whether every part ran and every byte arrived intact, and whether its ratio
    holds its guard (else an error that says which)."""
    result = await run_async(args, state)
    result["intact"] = completed(result, args.only)
    if not result["intact"] and "error" not in result:
        result["error"] = "bytes were lost or corrupted (see the flows marked intact: false)"
    below = guard(result) if args.only != "cap-on" else None  # the ratio is cap off's
    result["guard"] = {"relayed_over_sealed_chain_at_least": GUARD_RELAYED_OVER_SEALED_CHAIN}
    if below is not None and "error" not in result:
        result["error"] = below
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    if shutil.which("socat") is None:
        return {"error": "socat is not installed (Debian socat; make system-deps)"}
    result = run_bench("nodus-bench-relay-", lambda state: measured(args, state), args, cleanup)
    result["harness_nice_while_streaming"] = HARNESS_NICE if can_renice() else 0
    result["intact"] = result.pop("intact", False)  # last, as before; False if the run failed
    return result


def main(argv: Sequence[str] | None = None) -> int:
    return bench_main(run, parse_args(argv), cleanup)


if __name__ == "__main__":
    sys.exit(main())

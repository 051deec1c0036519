"""The Relayed-path bench's scenarios, each on its own system: `cap_off` (one pair, relays
without the rate limit: the Relayed path against a direct connection and socat relays),
`cap_on` (a gang alone, every gang at once), `failover` (a relay SIGKILLed mid-stream) and,
with a third relay, `rescue` (both of a gang's relays SIGKILLed mid-stream and left down).
See tests/bench/relay.py for what each measures."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import statistics
import time
from typing import Any

from libs.contracts.bounds import derive
from libs.contracts.jobs import PathClass
from services.agent.relayed.homing import RESCUE_SECONDS
from tests.bench.relay_streams import (
    Flow,
    FlowSpec,
    Opener,
    all_intact,
    jain,
    longest_gap_ms,
    public,
    rate_between,
    ratio,
    stream,
)
from tests.bench.relay_system import Bench, Gang, log
from tests.bench.running import sleep_until
from tests.bench.sampling import written_bytes

POLL = 0.02  # seconds between `epochs` requests while waiting for a member to move
# A relay started again is up and has published what it metered before its kill.
RESTART_AND_FLUSH = 4.0


async def relays_carrying(bench: Bench, gang: Gang, sink: Any) -> list[str]:
    """The relays that wrote at least half of what a short A -> B stream delivered."""
    relays = {r: bench.pids(r) for r in bench.relay_names()}
    before = {r: sum(written_bytes(p) for p in pids) for r, pids in relays.items()}
    measure = await stream(
        [FlowSpec("a_to_b", sink, bench.via_socks(gang.socks[0]))], 1.5, 0.5, procs={}
    )
    delivered = sum(f["received_bytes"] for f in measure["flows"].values())
    wrote = {r: sum(written_bytes(p) for p in pids) - before[r] for r, pids in relays.items()}
    log(f"cap off: relays wrote {wrote} while {delivered} bytes were delivered A -> B")
    return sorted(r for r, n in wrote.items() if n >= delivered / 2)


async def cap_off(bench: Bench) -> dict[str, Any]:
    [gang] = await bench.up("cap-off", 1, ["--no-rate-limit"])
    assert gang.sinks is not None
    sink_b = gang.sinks[1]
    # The chain gets as many hops as processes the relayed bytes pass through: both members'
    # dataplanes and the relays that carry them, as measured (a relay delivers straight to a
    # member connected to it, home or not, so one relay may carry a stream both members'
    # homes differ on).
    carrying = await relays_carrying(bench, gang, sink_b)
    hops = 2 + len(carrying)
    port1, socat1 = await bench.socat_chain(1, sink_b)
    port_n, socat_n = await bench.socat_chain(hops, sink_b)
    port_s, socat_s = await bench.socat_chain(hops, sink_b, sealed=True)
    await asyncio.sleep(0.2)  # let the probes' forked children exit
    paths: dict[str, tuple[Opener, dict[str, list[int]]]] = {
        "direct": (bench.direct(gang.hosts[0]), {}),
        "socat": (bench.to("127.0.0.1", port1), {"socat": socat1}),
        "socat_chain": (bench.to("127.0.0.1", port_n), {"socat": socat_n}),
        "sealed_chain": (bench.to("127.0.0.1", port_s), {"socat": socat_s}),
        "relayed": (bench.via_socks(gang.socks[0]), bench.gang_procs(gang)),
    }
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in paths}
    order = list(paths)
    for round_no in range(bench.args.rounds):
        shift = round_no % len(order)
        for path in order[shift:] + order[:shift]:
            opener, procs = paths[path]
            specs = [FlowSpec("a_to_b", sink_b, opener)]
            window = {"seconds": bench.args.seconds, "warmup": bench.args.warmup, "procs": procs}
            if path == "relayed":
                measure = await bench.relayed([gang], specs, **window)
            else:
                measure = await stream(specs, **window, tree=path != "direct")
            runs[path].append(public(measure))
            log(
                f"cap off, round {round_no + 1}/{bench.args.rounds}: {path} "
                f"{measure['total_mbit_s']} Mbit/s, {measure['cpu_s_per_gbit']} CPU s/Gbit"
            )
    # Both ways at once through the relays, for the CPU of a full-duplex gang.
    assert gang.sinks is not None
    both = await bench.relayed(
        [gang],
        [
            FlowSpec("a_to_b", gang.sinks[1], bench.via_socks(gang.socks[0])),
            FlowSpec("b_to_a", gang.sinks[0], bench.via_socks(gang.socks[1])),
        ],
        seconds=bench.args.seconds,
        warmup=bench.args.warmup,
        procs=bench.gang_procs(gang),
    )
    log(f"cap off, relayed both ways: {both['total_mbit_s']} Mbit/s")
    out: dict[str, Any] = {
        "homes": gang.homes,
        "gang": gang.lifecycle,
        "relays_carrying_a_to_b": carrying,
        "socat_chain_hops": hops,
    }
    for path, measures in runs.items():
        rates = [m["total_mbit_s"] for m in measures]
        cpus = [m["cpu_s_per_gbit"] for m in measures if m["cpu_s_per_gbit"] is not None]
        own = [m["harness_cpu_s_per_gbit"] for m in measures if m["harness_cpu_s_per_gbit"]]
        out[path] = {
            "mbit_s_median": round(statistics.median(rates), 1),
            "mbit_s_best": max(rates),
            "mbit_s_runs": rates,
            "cpu_s_per_gbit_median": round(statistics.median(cpus), 3) if cpus else None,
            "harness_cpu_s_per_gbit_median": round(statistics.median(own), 3) if own else None,
            "cpu_s_by_process_last_run": measures[-1]["cpu_s"],
            "longest_gap_ms_max": max(m["flows"]["a_to_b"]["longest_gap_ms"] for m in measures),
            "others_busy_cores_max": max(m["others_busy_cores"] for m in measures),
            "intact": all(all_intact(m) for m in measures),
        }
        if path == "relayed":
            out[path]["relay_cpu_s_per_gbit_median"] = statistics.median(
                m["relay_cpu_s_per_gbit"] for m in measures
            )
            out[path]["agent_cpu_s_per_gbit_median"] = statistics.median(
                m["agent_cpu_s_per_gbit"] for m in measures
            )
            out[path]["billed_over_delivered"] = [m["billed_over_delivered"] for m in measures]
    out["relayed_both_ways"] = public(both)
    relayed, direct, socat = out["relayed"], out["direct"], out["socat"]
    out["ratios"] = {
        "relayed_over_direct": ratio(relayed["mbit_s_median"], direct["mbit_s_median"]),
        "relayed_over_socat": ratio(relayed["mbit_s_median"], socat["mbit_s_median"]),
        "relayed_over_socat_chain": ratio(
            relayed["mbit_s_median"], out["socat_chain"]["mbit_s_median"]
        ),
        "socat_over_direct": ratio(socat["mbit_s_median"], direct["mbit_s_median"]),
        "cpu_per_gbit_relayed_over_socat": ratio(
            relayed["cpu_s_per_gbit_median"], socat["cpu_s_per_gbit_median"]
        ),
        "cpu_per_gbit_relayed_over_socat_chain": ratio(
            relayed["cpu_s_per_gbit_median"], out["socat_chain"]["cpu_s_per_gbit_median"]
        ),
        # The same hops doing the same cryptography (ChaCha20-Poly1305 sealed at the first,
        # opened at the last): what the Relayed path's own overhead is measured against.
        "relayed_over_sealed_chain": ratio(
            relayed["mbit_s_median"], out["sealed_chain"]["mbit_s_median"]
        ),
        "cpu_per_gbit_relayed_over_sealed_chain": ratio(
            relayed["cpu_s_per_gbit_median"], out["sealed_chain"]["cpu_s_per_gbit_median"]
        ),
    }
    await bench.down()
    return out


async def cap_on(bench: Bench) -> dict[str, Any]:
    gangs = await bench.up("cap-on", bench.args.gangs, [], relays=bench.args.relays)
    share = derive(PathClass.RELAYED, 2).relay_member_bits_per_second / 1e6
    first = gangs[0]
    assert first.sinks is not None
    a_to_b = FlowSpec("a_to_b", first.sinks[1], bench.via_socks(first.socks[0]))
    b_to_a = FlowSpec("b_to_a", first.sinks[0], bench.via_socks(first.socks[1]))
    procs = bench.gang_procs(first)
    seconds, warmup = bench.args.seconds, bench.args.warmup
    one: dict[str, Any] = {
        "homes": first.homes,
        "gang": first.lifecycle,
        "member_share_mbit_s": share,
    }
    for label, specs in (
        ("a_to_b_alone", [a_to_b]),
        ("b_to_a_alone", [b_to_a]),
        ("both_at_once", [a_to_b, b_to_a]),
    ):
        measure = public(
            await bench.relayed([first], specs, seconds=seconds, warmup=warmup, procs=procs)
        )
        for flow in measure["flows"].values():
            flow["over_share"] = ratio(flow["mbit_s"], share)
        one[label] = measure
        log(f"cap on, one gang, {label}: {measure['total_mbit_s']} Mbit/s")
    result: dict[str, Any] = {"one_gang": one}

    specs = []
    for gang in gangs:
        assert gang.sinks is not None
        specs += [
            FlowSpec(f"{gang.name}/a_to_b", gang.sinks[1], bench.via_socks(gang.socks[0])),
            FlowSpec(f"{gang.name}/b_to_a", gang.sinks[0], bench.via_socks(gang.socks[1])),
        ]
    everyone = {c.name: [c.process.pid] for c in bench.system.children} if bench.system else {}
    relays_and_agents = {n: p for n, p in everyone.items() if n.startswith(("agent", "relay"))}
    many = public(
        await bench.relayed(
            gangs,
            specs,
            seconds=max(seconds, 4.0),
            warmup=warmup,
            procs=relays_and_agents,
            drain=120.0,
        )
    )
    per_gang = {
        g.name: round(
            many["flows"][f"{g.name}/a_to_b"]["mbit_s"]
            + many["flows"][f"{g.name}/b_to_a"]["mbit_s"],
            1,
        )
        for g in gangs
    }
    rates = list(per_gang.values())
    cpu = many["cpu_s"]
    # Where each gang's bytes went: through one relay, or across the mesh between both.
    paths = {g.name: "+".join(sorted({str(h) for h in g.homes.values()})) for g in gangs}
    by_path: dict[str, list[float]] = {}
    for name, path in paths.items():
        by_path.setdefault(path, []).append(per_gang[name])
    homes = [h for g in gangs for h in g.homes.values()]
    result["gangs"] = {
        "gangs": len(gangs),
        "homes": {n: h for g in gangs for n, h in g.homes.items()},
        "members_per_relay": {str(h): homes.count(h) for h in sorted(set(homes), key=str)},
        "gang_relays": paths,
        "mean_gang_mbit_s_by_relays": {
            path: round(statistics.fmean(values), 1) for path, values in by_path.items()
        },
        "phases": {g.name: g.lifecycle["phase"] for g in gangs},
        "probe_tcp_gbps": {g.name: g.lifecycle.get("probe", {}).get("tcp_gbps") for g in gangs},
        "aggregate_mbit_s": many["total_mbit_s"],
        "gang_cap_mbit_s": derive(PathClass.RELAYED, 2).relay_gang_bits_per_second / 1e6,
        "per_gang_mbit_s": per_gang,
        "per_flow_mbit_s": {n: f["mbit_s"] for n, f in many["flows"].items()},
        "jain_fairness": jain(rates),
        "min_over_max": ratio(min(rates), max(rates)),
        "cpu_s": {
            "relays": round(sum(v for n, v in cpu.items() if n.startswith("relay")), 3),
            "agents": round(sum(v for n, v in cpu.items() if n.startswith("agent")), 3),
            "window_s": many["window_s"],
        },
        "cpu_s_by_relay": {n: v for n, v in cpu.items() if n.startswith("relay")},
        "cpu_s_per_gbit": many["cpu_s_per_gbit"],
        "relay_cpu_s_per_gbit": many["relay_cpu_s_per_gbit"],
        "agent_cpu_s_per_gbit": many["agent_cpu_s_per_gbit"],
        "longest_gap_ms_max": max(f["longest_gap_ms"] for f in many["flows"].values()),
        "billed_over_delivered": many["billed_over_delivered"],
        "machine_busy_cores": many["machine_busy_cores"],
        "others_busy_cores": many["others_busy_cores"],
        "intact": all_intact(many),
    }
    log(
        f"cap on, {len(gangs)} gangs: {many['total_mbit_s']} Mbit/s, "
        f"Jain {result['gangs']['jain_fairness']}"
    )
    result["failover"] = await failover(bench, first, a_to_b, b_to_a)
    if bench.args.relays >= 3:
        result["rescue"] = await rescue(bench, first, a_to_b, b_to_a)
    await bench.down()
    return result


async def _moved_off(
    bench: Bench, gang: Gang, victims: list[str], killed: float, until: float
) -> tuple[dict[str, float | None], dict[str, str | None]]:
    """Seconds from `killed` until each member's agent names a relay other than `victims` as
    its home (polled every POLL s until `until`; None if not by then), and that relay."""
    moved: dict[str, float | None] = dict.fromkeys(gang.nodes)
    homes: dict[str, str | None] = dict.fromkeys(gang.nodes)
    while None in moved.values() and time.monotonic() < until:
        for node in [n for n, t in moved.items() if t is None]:
            try:
                home = await bench.joined(node)
            except Exception:  # the agent busy: ask again
                continue
            if home is not None and home not in victims:
                moved[node] = round(time.monotonic() - killed, 3)
                homes[node] = home
        await asyncio.sleep(POLL)
    return moved, homes


async def _returns(
    bench: Bench, before: dict[str, str | None], victim: str, until: float
) -> dict[str, float | None]:
    """When each member homed on `victim` before it was killed was homed on it again (the
    relay back and up for the agents' wait), polled until `until`; None if not by then."""
    returned: dict[str, float | None] = {n: None for n, home in before.items() if home == victim}
    while time.monotonic() < until and None in returned.values():
        for node in [n for n, t in returned.items() if t is None]:
            try:
                if await bench.joined(node) == victim:
                    returned[node] = time.monotonic()
            except Exception:  # the agent busy: ask again
                continue
        await asyncio.sleep(POLL)
    return returned


def _gap_around(flow: Flow, returned: dict[str, float | None], stop: float) -> float | None:
    """The longest interval with no byte delivered within 0.5 s of the first return home."""
    moments = [t for t in returned.values() if t is not None and t < stop]
    if not moments:
        return None
    at = min(moments)
    return longest_gap_ms(flow, at - 0.5, min(at + 0.5, stop))


async def failover(bench: Bench, gang: Gang, a_to_b: FlowSpec, b_to_a: FlowSpec) -> dict[str, Any]:
    before = await bench.homes(list(gang.nodes))
    victim = before[gang.nodes[0]]
    assert victim is not None and bench.system is not None
    child = next(c for c in bench.system.children if c.name == victim)

    async def kill(t0: float, _: dict[str, Flow]) -> dict[str, Any]:
        await sleep_until(t0 + bench.args.kill_at)
        killed = time.monotonic()
        os.kill(child.process.pid, signal.SIGKILL)
        moved, reported = await _moved_off(bench, gang, [victim], killed, killed + 30)
        # Started again on its usage journal, as its supervisor (systemd, `nodus up`'s
        # caller) would: it publishes what it metered before the kill (billing.py).
        assert bench.system is not None
        bench.system.restart(victim)
        restarted = time.monotonic()
        returned = await _returns(bench, before, victim, t0 + bench.args.failover_seconds)
        return {
            "killed_at": killed,
            "time_to_move_s": moved,
            "homes_after": reported,
            "restarted_at": restarted,
            "returned_at": returned,
            "time_to_return_s": {
                n: round(t - restarted, 3) if t is not None else None for n, t in returned.items()
            },
        }

    measure = await bench.relayed(
        [gang],
        [a_to_b, b_to_a],
        seconds=bench.args.failover_seconds,
        warmup=bench.args.warmup,
        procs=bench.gang_procs(gang),
        action=kill,
    )
    action = measure["action"]
    killed = action.pop("killed_at")
    action.pop("restarted_at")
    returned = action.pop("returned_at")
    gaps = _delivery_after_kill(bench, measure["_flows"], killed, bench.args.failover_seconds)
    t0 = killed - bench.args.kill_at
    stop = t0 + bench.args.failover_seconds  # the senders stop here
    for name, flow in measure["_flows"].items():
        # The members moved home again, under the stream, once the relay was back.
        gaps[name]["longest_gap_around_return_ms"] = _gap_around(flow, returned, stop)
    return {
        "killed": victim,
        "homes_before": before,
        **action,
        "delivery": gaps,
        "mbit_s_over_stream": {n: f["mbit_s"] for n, f in measure["flows"].items()},
        # The killed relay's counts survive in its usage journal and are published when
        # it starts again (billing.py); resends through the other relay add.
        "billed_over_delivered": measure["billed_over_delivered"],
        "killed_relay_restarted": True,
        "others_busy_cores": measure["others_busy_cores"],
        "intact": all_intact(measure),
    }


def _delivery_after_kill(
    bench: Bench, flows: dict[str, Flow], killed: float, seconds: float
) -> dict[str, Any]:
    """Each flow's delivery around a kill `kill_at` s into a stream of `seconds`: its longest
    pause from 0.5 s before the kill until the senders stop, and its rates."""
    gaps: dict[str, Any] = {}
    t0 = killed - bench.args.kill_at
    stop = t0 + seconds  # the senders stop here
    for name, flow in flows.items():
        # Intervals between deliveries that overlap [kill - 0.5 s, senders stop].
        times = [t for t, _ in flow.timeline if t < stop]
        around = [(b - a, a) for a, b in itertools.pairwise(times) if b > killed - 0.5 and a < stop]
        longest, at = max(around, default=(None, None))
        at_kill = max((n for t, n in flow.timeline if t < killed), default=0)
        after = min(1.0, stop - killed)
        gaps[name] = {
            "longest_gap_ms": round(longest * 1e3, 1) if longest is not None else None,
            "gap_started_after_kill_ms": round((at - killed) * 1e3, 1) if at is not None else None,
            "longest_gap_before_kill_ms": longest_gap_ms(flow, t0 + bench.args.warmup, killed),
            "mbit_s_1s_before_kill": rate_between(flow, killed - 1.0, killed),
            "mbit_s_after_kill": rate_between(flow, killed, killed + after),
            "after_kill_window_s": round(after, 3),
            "bytes_after_kill": flow.received - at_kill,
            "intact": flow.intact and flow.sent == flow.received,
        }
    return gaps


async def rescue(bench: Bench, gang: Gang, a_to_b: FlowSpec, b_to_a: FlowSpec) -> dict[str, Any]:
    """Both of the gang's relays SIGKILLed at once mid-stream and left down (their host lost):
    how long until each member is on another relay (homing.RESCUE_SECONDS, then a connect),
    the longest pause of the stream, and the bill. Both are started again once the stream is
    over, so that what they metered is published (billing.py). Needs a third relay."""
    assert bench.system is not None and len(gang.relays) == 2
    victims = gang.relays
    children = [c for c in bench.system.children if c.name in victims]
    # Long enough for the members' wait and a few seconds through the third relay.
    seconds = max(bench.args.failover_seconds, bench.args.kill_at + RESCUE_SECONDS + 4.0)

    async def kill_both(t0: float, _: dict[str, Flow]) -> dict[str, Any]:
        await sleep_until(t0 + bench.args.kill_at)
        killed = time.monotonic()
        for child in children:
            os.kill(child.process.pid, signal.SIGKILL)
        moved, homes = await _moved_off(bench, gang, victims, killed, t0 + seconds)
        return {"killed_at": killed, "time_to_rescue_s": moved, "homes_after": homes}

    before = await bench.billed([gang])
    measure = await stream(
        [a_to_b, b_to_a],
        seconds=seconds,
        warmup=bench.args.warmup,
        procs=bench.gang_procs(gang),
        action=kill_both,
    )
    for victim in victims:
        bench.system.restart(victim)
    await asyncio.sleep(RESTART_AND_FLUSH)
    delivered = sum(f["received_bytes"] for f in measure["flows"].values())
    billed = await bench.billed([gang]) - before
    action = measure["action"]
    killed = action.pop("killed_at")
    return {
        "killed": victims,
        **action,
        "stream_s": seconds,
        "delivery": _delivery_after_kill(bench, measure["_flows"], killed, seconds),
        "billed_over_delivered": round(billed / delivered, 4) if delivered else None,
        "intact": all_intact(measure),
    }

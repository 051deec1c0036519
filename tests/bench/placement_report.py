"""The placement bench's figures: distributions, the placer's own counters and log, what the
burst saw (apply -> Placed, decisions per second), the Planner alone over the same fleet,
and the ratios to the baseline. See tests/bench/placement.py."""

from __future__ import annotations

import contextlib
import json
import math
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from libs.contracts.fleet import NodeRecord
from libs.contracts.jobs import Job
from libs.contracts.placer import PlacerConfig
from services.placer.candidates import Candidates
from services.placer.planner import Exclusions, Planner

# A client's default apply timeout (libs.client.Client.apply): replies slower than this would
# have been errors for a user; the bench waits longer so it can measure them.
CLIENT_DEFAULT_APPLY_TIMEOUT = 10.0
# Sequential KV round trips a placement waits on in services/placer/commit.py (leases; epoch;
# join keys; job update; ranktable; event), Relayed claims not counted. Since placements are
# committed in batches, each is one round trip for the whole batch: the "KV floor" is what one
# job placed alone would wait, and a batch of many beats it by design.
SERIAL_KV_OPS_PER_PLACEMENT = 6


# -- statistics --------------------------------------------------------------------------------


def percentile(values: list[float], p: float) -> float | None:
    """Nearest rank."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(p / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def dist_ms(seconds: list[float]) -> dict[str, Any]:
    ms = [s * 1000 for s in seconds]
    if not ms:
        return {"n": 0}
    return {
        "n": len(ms),
        "p50": round(percentile(ms, 50) or 0, 3),
        "p90": round(percentile(ms, 90) or 0, 3),
        "p99": round(percentile(ms, 99) or 0, 3),
        "max": round(max(ms), 3),
        "mean": round(sum(ms) / len(ms), 3),
    }


def ratio(a: Any, b: Any) -> float | None:
    if not a or not b:
        return None
    return round(float(a) / float(b), 1)


def scrape(port: int) -> dict[str, float]:
    """The placer's /metrics, flattened: 'name{labels}' -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    metrics: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                metrics[name] = float(value)
    return metrics


def scrape_all(ports: list[int]) -> dict[str, float]:
    """Every replica's /metrics, summed (counters and histogram sums and counts add up)."""
    total: Counter[str] = Counter()
    for port in ports:
        total.update(scrape(port))
    return dict(total)


def placer_log_summary(path: Path) -> dict[str, Any]:
    levels: Counter[str] = Counter()
    ready: str | None = None
    problems: list[str] = []
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return {}
    for line in text.splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if not isinstance(entry, dict):
            continue
        level = str(entry.get("level", ""))
        levels[level] += 1
        message = str(entry.get("msg", ""))
        if " ready with " in message:
            ready = message
        if level in ("warning", "error", "critical") and len(problems) < 5:
            problems.append(message[:300])
    return {"levels": dict(levels), "ready_line": ready, "first_problems": problems}


@dataclass
class Burst:
    sent: dict[str, float] = field(default_factory=dict)  # perf_counter at send
    sent_wall: dict[str, float] = field(default_factory=dict)
    replied: dict[str, float] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)  # key -> error code
    placed_seen: dict[str, float] = field(default_factory=dict)  # perf_counter at first Placed
    placed_wall: dict[str, float] = field(default_factory=dict)  # status.placedTime
    unschedulable: dict[str, float] = field(default_factory=dict)
    paths: dict[str, str] = field(default_factory=dict)
    relay_homes: list[tuple[str, str]] = field(default_factory=list)  # Relayed (node, relay)
    named_relays: int = 0  # gangs given two relays by name (Relayed and Direct)


def placement_figures(burst: Burst, jobs: list[Job], start: float, end: float) -> dict[str, Any]:
    placed = burst.placed_seen
    to_placed = [placed[k] - burst.sent[k] for k in placed if k in burst.sent]
    recorded = [
        burst.placed_wall[k] - burst.sent_wall[k] for k in burst.placed_wall if k in burst.sent_wall
    ]
    apply_latency = [
        burst.replied[k] - burst.sent[k] for k in burst.replied if k not in burst.refused
    ]
    first_send = min(burst.sent.values(), default=start)
    last_placed = max(placed.values(), default=first_send)
    last_decision = max([*placed.values(), *burst.unschedulable.values()], default=first_send)
    placed_wall = last_placed - first_send
    decision_wall = last_decision - first_send
    decided = len(placed) + len(burst.unschedulable) + len(burst.refused)
    refused_codes = Counter(burst.refused.values())
    last_reply = max(burst.replied.values(), default=first_send)
    early = [t for t in placed.values() if t <= last_reply]
    return {
        "submitted": len(jobs),
        "placed": len(placed),
        "unschedulable": len(burst.unschedulable),
        "refused": len(burst.refused),
        "refused_codes": dict(refused_codes),
        "undecided": len(jobs) - decided,
        "paths": dict(Counter(burst.paths.values())),
        "gangs_with_named_relays": burst.named_relays,
        "relayed_members_per_relay": dict(sorted(Counter(r for _, r in burst.relay_homes).items())),
        "machines_leased": sum(j.spec.distributed.members for j in jobs if j.key in placed),
        "wall_s_first_apply_to_last_placed": round(placed_wall, 3),
        "wall_s_first_apply_to_last_decision": round(decision_wall, 3),
        "decisions_per_second": round(len(placed) / placed_wall, 1) if placed_wall else None,
        "decisions_per_second_incl_unschedulable": round(
            (len(placed) + len(burst.unschedulable)) / decision_wall, 1
        )
        if decision_wall
        else None,
        "apply_to_placed_ms": dist_ms(to_placed),
        "apply_to_placed_recorded_ms": dist_ms(recorded),
        "apply_to_unschedulable_ms": dist_ms(
            [t - burst.sent[k] for k, t in burst.unschedulable.items() if k in burst.sent]
        ),
        "apply_reply_ms": dist_ms(apply_latency),
        "apply_replies_slower_than_client_default": sum(
            1 for s in apply_latency if s > CLIENT_DEFAULT_APPLY_TIMEOUT
        ),
        "last_apply_reply_s": round(last_reply - first_send, 3),
        # Applies and placements share the placer's event loop: the rate while applies are
        # still being answered, and once they all are.
        "placed_while_applying": len(early),
        "decisions_per_second_while_applying": round(len(early) / (last_reply - first_send), 1)
        if last_reply > first_send
        else None,
        "decisions_per_second_after_last_apply_reply": round(
            (len(placed) - len(early)) / (last_placed - last_reply), 1
        )
        if last_placed > last_reply
        else None,
        "burst_wall_s": round(end - start, 3),
    }


def planner_only(config: PlacerConfig, fleet: list[NodeRecord], jobs: list[Job]) -> dict[str, Any]:
    """The CPU floor of the decisions: the placer's own Planner over the same fleet and jobs,
    in this process, serially, no bus (taken machines leave the free view as leases would)."""
    planner = Planner(config)
    free = Candidates(fleet)  # the placer's own index of free machines
    times: list[float] = []
    outcomes: Counter[str] = Counter()
    for job in jobs:
        t0 = time.perf_counter()
        plan, _ = planner.plan(job, free, Exclusions())
        times.append(time.perf_counter() - t0)
        if plan is None:
            outcomes["unschedulable"] += 1
            continue
        outcomes[plan.path.value] += 1
        for node in plan.nodes:
            free.remove(node)
    total = sum(times)
    return {
        "plan_ms": dist_ms(times),
        "plan_seconds_total": round(total, 3),
        "decisions_per_second": round(len(times) / total, 1) if total else None,
        "outcomes": dict(outcomes),
    }


def internal_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    count = delta("nodus_placer_place_seconds_count")
    total = delta("nodus_placer_place_seconds_sum")
    return {
        "place_calls": int(count),
        "place_seconds_total": round(total, 3),
        "place_ms_mean": round(1000 * total / count, 3) if count else None,
        "decisions": {
            outcome: int(delta(f'nodus_placer_decisions_total{{outcome="{outcome}"}}'))
            for outcome in ("placed", "unschedulable", "gave_up")
        },
        "admissions": {
            outcome: int(delta(f'nodus_placer_admissions_total{{outcome="{outcome}"}}'))
            for outcome in ("admitted", "refused", "unchanged")
        },
        "conflicts": {
            k.split('"')[1]: int(delta(k))
            for k in after
            if k.startswith("nodus_placer_conflicts_total{")
        },
    }


def ratios(result: dict[str, Any]) -> dict[str, Any]:
    base = result.get("baseline", {})
    placement = result.get("placement", {})
    internal = result.get("placer_internal", {})
    planner = result.get("planner_only", {})
    rtt = base.get("nats_rtt_ms", {})
    burst = base.get("nats_rtt_burst_ms", {})
    kv = base.get("kv_put_ms", {})
    to_placed = placement.get("apply_to_placed_ms", {})
    reply = placement.get("apply_reply_ms", {})
    kv_floor_ms = (kv.get("p50") or 0) * SERIAL_KV_OPS_PER_PLACEMENT
    return {
        "apply_to_placed_p50_over_nats_rtt_p50": ratio(to_placed.get("p50"), rtt.get("p50")),
        "apply_to_placed_p99_over_nats_rtt_p99": ratio(to_placed.get("p99"), rtt.get("p99")),
        "apply_to_placed_p50_over_kv_put_p50": ratio(to_placed.get("p50"), kv.get("p50")),
        "apply_reply_p50_over_nats_rtt_p50": ratio(reply.get("p50"), rtt.get("p50")),
        "apply_reply_p99_over_burst_rtt_p99": ratio(reply.get("p99"), burst.get("p99")),
        "place_ms_mean_over_kv_put_p50": ratio(internal.get("place_ms_mean"), kv.get("p50")),
        "place_ms_mean_over_planner_only_plan_ms_mean": ratio(
            internal.get("place_ms_mean"), planner.get("plan_ms", {}).get("mean")
        ),
        # What one serial worker could reach if a placement cost only its KV round trips.
        "kv_floor_ms_per_placement": round(kv_floor_ms, 3) if kv_floor_ms else None,
        "kv_floor_decisions_per_second": round(1000 / kv_floor_ms, 1) if kv_floor_ms else None,
        "decisions_per_second_over_kv_floor": ratio(
            placement.get("decisions_per_second"), 1000 / kv_floor_ms if kv_floor_ms else None
        ),
    }

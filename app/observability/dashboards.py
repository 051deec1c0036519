"""The Grafana dashboards in deploy/grafana/, generated as code (O3) with Grafana Labs'
grafana-foundation-sdk, so they stay in step with the metrics the daemons export.

    .venv/bin/python -m app.observability     # writes deploy/grafana/*.json

A test regenerates them and compares (tests/unit/test_dashboards.py), and checks against a
live system that every metric a panel names is exported by some daemon and that the panels
have data (tests/e2e/test_observability.py). Counters with labels that nothing has touched
yet have no series: their panels add `or vector(0)`, so "nothing dropped" shows as 0.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders.dashboard import Dashboard, Row
from grafana_foundation_sdk.builders.prometheus import Dataquery as PrometheusQuery
from grafana_foundation_sdk.builders.timeseries import Panel as Timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "grafana"
RATE = "$__rate_interval"


@dataclass(frozen=True)
class Graph:
    title: str
    expr: str
    unit: str = "short"
    legend: str = ""


def _rate(metric: str, by: str, scale: str = "") -> str:
    return f"sum by ({by}) (rate({metric}[{RATE}])){scale} or vector(0)"


RELAYS = {
    "Traffic": [
        Graph(
            "Bytes members sent, by gang",
            _rate('nodus_relay_bytes_total{direction="in"}', "gang", " * 8"),
            "bps",
            "{{gang}}",
        ),
        Graph(
            "Bytes by member and direction",
            _rate("nodus_relay_bytes_total", "gang, member, direction", " * 8"),
            "bps",
            "{{member}} {{direction}}",
        ),
        Graph(
            "Rate-limit wait, by gang",
            _rate("nodus_relay_bucket_wait_seconds_total", "gang"),
            "percentunit",
            "{{gang}}",
        ),
    ],
    "Drops": [
        Graph(
            "Frames dropped, by reason",
            _rate("nodus_relay_frames_dropped_total", "reason"),
            "pps",
            "{{reason}}",
        ),
        Graph(
            "Dropped for a destination, by reason",
            _rate("nodus_relay_destination_drops_total", "gang, member, reason"),
            "pps",
            "{{member}} {{reason}}",
        ),
        Graph(
            "Sessions refused, by reason",
            _rate("nodus_relay_sessions_refused_total", "reason"),
            "ops",
            "{{reason}}",
        ),
    ],
    "Sessions and mesh": [
        Graph("Member sessions", "sum by (daemon) (nodus_relay_sessions)", "short", "{{daemon}}"),
        Graph("Mesh links up", "sum by (daemon) (nodus_relay_mesh_peers)", "short", "{{daemon}}"),
        Graph(
            "Mesh links lost",
            _rate("nodus_relay_mesh_peer_losses_total", "daemon, peer"),
            "ops",
            "{{daemon}} to {{peer}}",
        ),
        Graph(
            "Members arriving after a failover",
            _rate("nodus_relay_failovers_total", "daemon"),
            "ops",
            "{{daemon}}",
        ),
        Graph(
            "Members handed to their relay on the host's shared port",
            _rate("nodus_relay_handoffs_total", "daemon"),
            "ops",
            "{{daemon}}",
        ),
        Graph(
            "STUN requests, by outcome",
            _rate("nodus_relay_stun_requests_total", "outcome"),
            "reqps",
            "{{outcome}}",
        ),
    ],
}

AGENTS = {
    "Tunnels (Relayed)": [
        Graph(
            "TCP streams open", "sum by (node) (nodus_agent_tunnel_streams)", "short", "{{node}}"
        ),
        Graph(
            "Stream resets, by reason",
            _rate("nodus_agent_stream_resets_total", "node, reason"),
            "ops",
            "{{node}} {{reason}}",
        ),
        Graph(
            "Relay failovers",
            _rate("nodus_agent_relay_failovers_total", "node"),
            "ops",
            "{{node}}",
        ),
        Graph(
            "Returns home to the chosen relay",
            _rate("nodus_agent_relay_returns_total", "node"),
            "ops",
            "{{node}}",
        ),
        Graph(
            "Relays given beyond the gang's two (both lost)",
            _rate("nodus_agent_relay_rescues_total", "node"),
            "ops",
            "{{node}}",
        ),
        Graph(
            "WireGuard messages dropped, by reason",
            _rate("nodus_agent_wireguard_drops_total", "reason"),
            "pps",
            "{{reason}}",
        ),
        Graph(
            "WireGuard handshakes, by outcome",
            _rate("nodus_agent_wireguard_handshakes_total", "outcome"),
            "ops",
            "{{outcome}}",
        ),
        Graph(
            "SOCKS5 requests, by outcome",
            _rate("nodus_agent_socks_requests_total", "node, outcome"),
            "reqps",
            "{{node}} {{outcome}}",
        ),
    ],
    "Direct pairs": [
        Graph(
            "Pairs direct (1) or through the relays (0)",
            "nodus_agent_pair_direct or vector(1)",
            "short",
            "{{node}} to {{peer}}",
        ),
        Graph(
            "Direct paths lost",
            _rate("nodus_agent_pair_fallbacks_total", "node"),
            "ops",
            "{{node}}",
        ),
        Graph(
            "ICE rounds, by outcome",
            _rate("nodus_agent_ice_rounds_total", "outcome"),
            "ops",
            "{{outcome}}",
        ),
        Graph(
            "Fallback traffic through the relays",
            _rate("nodus_agent_fallback_bytes_total", "node, direction", " * 8"),
            "bps",
            "{{node}} {{direction}}",
        ),
    ],
    "Machines": [
        Graph("Epochs joined", "sum by (node) (nodus_agent_joined_epochs)", "short", "{{node}}"),
        Graph("Heartbeats", _rate("nodus_agent_heartbeats_total", "node"), "ops", "{{node}}"),
    ],
}

GANGS = {
    "Jobs": [
        Graph("Jobs by phase", "max by (phase) (nodus_runner_jobs)", "short", "{{phase}}"),
        Graph(
            "Gangs degraded (NetworkDegraded)",
            "max by (gang) (nodus_runner_network_degraded) or vector(0)",
            "short",
            "{{gang}}",
        ),
        Graph(
            "Runs, by outcome", _rate("nodus_runner_runs_total", "outcome"), "ops", "{{outcome}}"
        ),
    ],
    "Probes": [
        Graph(
            "Probe throughput per pair",
            "max by (gang, a, b, path) (nodus_runner_pair_tcp_gbps)",
            "Gbits",
            "{{gang}} {{a}}-{{b}} {{path}}",
        ),
        Graph(
            "Probe round trip per pair",
            "max by (gang, a, b, path) (nodus_runner_pair_rtt_seconds)",
            "s",
            "{{gang}} {{a}}-{{b}} {{path}}",
        ),
        Graph(
            "Probes, by outcome",
            _rate("nodus_runner_probes_total", "outcome"),
            "ops",
            "{{outcome}}",
        ),
    ],
    "Billing": [
        Graph(
            "Relay GiB sent, by gang (last hour)",
            'sum by (gang) (increase(nodus_relay_bytes_total{direction="in"}[1h])) / 2^30'
            " or vector(0)",
            "short",
            "{{gang}}",
        ),
    ],
}

PLACER = {
    "Placement": [
        Graph(
            "Decisions, by outcome",
            _rate("nodus_placer_decisions_total", "outcome"),
            "ops",
            "{{outcome}}",
        ),
        Graph(
            "Admissions, by outcome",
            _rate("nodus_placer_admissions_total", "outcome"),
            "ops",
            "{{outcome}}",
        ),
        Graph(
            "Time to place (p99)",
            "histogram_quantile(0.99, sum by (le) (rate(nodus_placer_place_seconds_bucket"
            f"[{RATE}]))) or vector(0)",
            "s",
            "p99",
        ),
        Graph(
            "Compare-and-set races lost",
            _rate("nodus_placer_conflicts_total", "what"),
            "ops",
            "{{what}}",
        ),
    ],
    "Capacity": [
        Graph("Free machines", "max(nodus_placer_free_nodes)", "short", "free"),
        Graph("Jobs waiting for capacity", "max(nodus_placer_waiting_jobs)", "short", "waiting"),
    ],
}

REMEDIATOR = {
    "Alerts": [
        Graph("Alerts firing", "max(nodus_remediator_alerts_firing)", "short", "firing"),
        Graph(
            "Alert transitions, by kind and state",
            _rate("nodus_remediator_alerts_total", "kind, state"),
            "ops",
            "{{kind}} {{state}}",
        ),
        Graph(
            "Recommendations", "max(nodus_remediator_recommendations)", "short", "recommendations"
        ),
        Graph("Signals, by source", _rate("nodus_remediator_signals_total", "source"), "ops"),
    ],
    "Remediations": [
        Graph(
            "Remediations not ended, by state",
            "max by (state) (nodus_remediator_remediations_active) or vector(0)",
            "short",
            "{{state}}",
        ),
        Graph(
            "Remediations, by action and outcome",
            _rate("nodus_remediator_remediations_total", "action, outcome"),
            "ops",
            "{{action}} {{outcome}}",
        ),
    ],
    "Guardrails": [
        Graph(
            "Breakers open, by cluster",
            "max by (cluster) (nodus_remediator_breaker_open) or vector(0)",
            "short",
            "{{cluster}}",
        ),
        Graph(
            "Budget and guardrail waits",
            _rate("nodus_remediator_guardrail_waits_total", "guardrail"),
            "ops",
            "{{guardrail}}",
        ),
    ],
}

DASHBOARDS: dict[str, tuple[str, dict[str, list[Graph]]]] = {
    "relays": ("Nodus relays", RELAYS),
    "agents": ("Nodus agents and tunnels", AGENTS),
    "gangs": ("Nodus gangs", GANGS),
    "placer": ("Nodus placer", PLACER),
    "remediator": ("Nodus remediator", REMEDIATOR),
}


def build(name: str) -> dict[str, Any]:
    title, rows = DASHBOARDS[name]
    dashboard = (
        Dashboard(title)
        .uid(f"nodus-{name}")
        .tags(["nodus", "generated"])
        .refresh("30s")
        .time("now-1h", "now")
    )
    for row, graphs in rows.items():
        dashboard = dashboard.with_row(Row(row))
        for graph in graphs:
            query = (
                PrometheusQuery()
                .expr(graph.expr)
                .legend_format(graph.legend or "__auto")
                .ref_id("A")
            )
            panel = Timeseries().title(graph.title).unit(graph.unit).min(0).with_target(query)
            dashboard = dashboard.with_panel(panel)
    document: dict[str, Any] = json.loads(
        JSONEncoder(sort_keys=True, indent=2).encode(dashboard.build())
    )
    return document


def render(name: str) -> str:
    return json.dumps(build(name), indent=2, sort_keys=True) + "\n"


def expressions() -> list[str]:
    return [
        graph.expr
        for _, rows in DASHBOARDS.values()
        for graphs in rows.values()
        for graph in graphs
    ]


def write(directory: Path = DEPLOY) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for name in DASHBOARDS:
        path = directory / f"{name}.json"
        path.write_text(render(name))
        written.append(path)
    return written

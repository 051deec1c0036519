"""The relay's Prometheus metrics (prefix nodus_relay_)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

BYTES = Counter(
    "nodus_relay_bytes_total",
    "WireGuard bytes through this relay by gang, member and direction (in: sent by the member)",
    ["gang", "member", "direction"],
)
DROPPED = Counter("nodus_relay_frames_dropped_total", "Frames dropped, by reason", ["reason"])
DESTINATION_DROPS = Counter(
    "nodus_relay_destination_drops_total",
    "Frames for a member that was gone or had stopped reading, dropped instead of waited for",
    ["gang", "member", "reason"],
)
REFUSED = Counter(
    "nodus_relay_sessions_refused_total", "Connections refused, by reason", ["reason"]
)
BUCKET_WAIT = Counter(
    "nodus_relay_bucket_wait_seconds_total",
    "Time a member's reads were paused by its rate limit",
    ["gang", "member"],
)
SESSIONS = Gauge("nodus_relay_sessions", "Member sessions connected")
MESH_PEERS = Gauge("nodus_relay_mesh_peers", "Mesh peers connected (outbound links up)")
MESH_LOSSES = Counter("nodus_relay_mesh_peer_losses_total", "Mesh links lost", ["peer"])
FAILOVERS = Counter(
    "nodus_relay_failovers_total",
    "Members that made this relay their home after losing their previous one",
)
HANDOFFS = Counter(
    "nodus_relay_handoffs_total",
    "Members' connections handed to the relay they named, another relay of this host's shared port",
)
USAGE_FLUSHES = Counter("nodus_relay_usage_records_total", "Usage records published", ["outcome"])

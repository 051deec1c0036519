"""The remediator's metrics (prefix `nodus_remediator_`)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

SIGNALS = Counter("nodus_remediator_signals_total", "Signal reports applied", ["source"])
SIGNALS_DROPPED = Counter(
    "nodus_remediator_signals_dropped_total",
    "Signal reports dropped: stale, or naming another node than their key (S1, S3)",
    ["reason"],
)
ALERTS = Counter("nodus_remediator_alerts_total", "Alert transitions", ["kind", "state"])
ALERTS_FIRING = Gauge("nodus_remediator_alerts_firing", "Alerts firing now")
RECOMMENDATIONS = Gauge("nodus_remediator_recommendations", "Recommendations now")
REMEDIATIONS = Counter(
    "nodus_remediator_remediations_total",
    "Remediations by action and how they ended",
    ["action", "outcome"],
)
TRANSITIONS = Counter(
    "nodus_remediator_transitions_total", "Remediation state transitions", ["state"]
)
ACTIVE = Gauge("nodus_remediator_remediations_active", "Remediations not ended", ["state"])
GUARDRAIL_WAITS = Counter(
    "nodus_remediator_guardrail_waits_total",
    "Times a repair waited on a guardrail",
    ["guardrail"],
)
BREAKER_OPEN = Gauge(
    "nodus_remediator_breaker_open", "1 while a cluster's breaker is open", ["cluster"]
)
BREAKER_TRIPS = Counter("nodus_remediator_breaker_trips_total", "Breaker trips", ["cluster"])
EXTERNAL = Counter(
    "nodus_remediator_external_requests_total", "External repair requests", ["outcome"]
)
CONFLICTS = Counter("nodus_remediator_conflicts_total", "Compare-and-set races lost", ["what"])
DECISION_SECONDS = Histogram(
    "nodus_remediator_decision_seconds",
    "From a signal report to its recommendation, after the persistence window",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
MEMBERS_LOST = Counter(
    "nodus_remediator_members_lost_total",
    "Running gangs whose epoch a fault ended at once: it broke what a member runs on (R17)",
)

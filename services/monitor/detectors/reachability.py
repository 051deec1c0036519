"""Host reachability, seen from the host side (R1): `failures` probes in a row that got no
answer, over at least `silent_for`, make a finding; one answer clears it. The probe asks the
machine's agent, and an agent that restarts (a crash, an upgrade) is silent for seconds: that
is not an unreachable host (O4), whose finding ends a running gang's epoch (R17). A stale heartbeat is a different thing (NotReady)
and never repairs alone (R3); `heartbeat` reports it for display only."""

from __future__ import annotations

from collections import deque
from datetime import datetime, timedelta

from libs.contracts import names
from libs.contracts.remediation import MAX_EVIDENCE_LINES, AlertKind, Evidence, Finding


class Reachability:
    def __init__(
        self, node: str, where: str, failures: int = 3, silent_for: timedelta = timedelta(0)
    ) -> None:
        self.node = node
        self.where = where
        self.failures = failures
        self.silent_for = silent_for
        self._failed = 0
        self._lines: deque[str] = deque(maxlen=MAX_EVIDENCE_LINES)
        self._since: datetime | None = None

    def record(self, reachable: bool, detail: str, now: datetime) -> None:
        if reachable:
            self._failed = 0
            self._lines.clear()
            self._since = None
            return
        self._failed += 1
        self._since = self._since or now
        self._lines.append(f"{now:%Y-%m-%dT%H:%M:%S}Z probe failed: {detail[:200]}")

    def findings(self, now: datetime) -> list[Finding]:
        if self._failed < self.failures or self._since is None:
            return []
        if now - self._since < self.silent_for:
            return []
        return [
            Finding(
                kind=AlertKind.HOST_UNREACHABLE,
                subject=self.where,
                severity="critical",
                detail=f"{self._failed} probes in a row failed over "
                f"{(now - self._since).total_seconds():.0f} s",
                evidence=Evidence(
                    kind=AlertKind.HOST_UNREACHABLE,
                    source="reachability",
                    node=self.node,
                    where=self.where,
                    observed_time=now,
                    severity="critical",
                    lines=list(self._lines),
                    values={"consecutiveFailures": float(self._failed)},
                ),
            )
        ]


def heartbeat(
    node: str, last_beat: datetime | None, timeout: timedelta, now: datetime
) -> list[Finding]:
    """NotReady: no heartbeat within `timeout`. Shown, never repaired on its own (R3)."""
    if last_beat is not None and now - last_beat <= timeout:
        return []
    age = "never" if last_beat is None else f"{(now - last_beat).total_seconds():.0f}s ago"
    return [
        Finding(
            kind=AlertKind.NODE_NOT_READY,
            subject="heartbeat",
            severity="info",
            detail=f"last heartbeat {age}",
            evidence=Evidence(
                kind=AlertKind.NODE_NOT_READY,
                source="heartbeat",
                node=node,
                where=names.BUCKET_HEALTH,
                observed_time=now,
                severity="info",
                lines=[f"last heartbeat {age}"],
            ),
        )
    ]

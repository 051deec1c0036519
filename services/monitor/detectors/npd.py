"""Node Problem Detector's conditions (R1): `ReadonlyFilesystem` (reason
`FilesystemIsReadOnly`) when the kernel remounted a filesystem read-only.

Accepts what NPD leaves behind in the shapes operators export it: a list of conditions, an
object with `conditions`, or a Kubernetes Node with `status.conditions`:

    [{"type": "ReadonlyFilesystem", "status": "True", "reason": "FilesystemIsReadOnly",
      "message": "Remounting filesystem read-only", "lastTransitionTime": "..."}]
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from libs.contracts.remediation import AlertKind, Evidence, Finding

WATCHED = {"ReadonlyFilesystem": AlertKind.READONLY_FILESYSTEM}
MAX_BYTES = 1 << 20


class Malformed(Exception):
    pass


def conditions(document: Any) -> list[dict[str, Any]]:
    if isinstance(document, dict):
        if isinstance(document.get("status"), dict):
            document = document["status"].get("conditions")
        else:
            document = document.get("conditions")
    if not isinstance(document, list):
        raise Malformed("no list of conditions")
    return [c for c in document if isinstance(c, dict)]


class NodeProblems:
    """Keeps the last good findings when a read is malformed (a file caught mid-write)."""

    def __init__(self, node: str, where: str) -> None:
        self.node = node
        self.where = where
        self.malformed = 0
        self._last: list[Finding] = []

    def observe(self, data: bytes, now: datetime) -> list[Finding]:
        if not data.strip():
            self._last = []
            return []
        try:
            if len(data) > MAX_BYTES:
                raise Malformed("too large")
            found = conditions(json.loads(data))
        except (Malformed, ValueError, RecursionError):
            self.malformed += 1
            return self._last
        findings = []
        for condition in found:
            kind = WATCHED.get(str(condition.get("type")))
            if kind is None or str(condition.get("status")) != "True":
                continue
            reason = str(condition.get("reason", ""))[:200]
            message = str(condition.get("message", ""))[:500]
            mount = str(condition.get("mount", condition.get("device", "/")))[:200] or "/"
            findings.append(
                Finding(
                    kind=kind,
                    subject=mount,
                    severity="critical",
                    detail=f"{reason}: {message}" if message else reason,
                    evidence=Evidence(
                        kind=kind,
                        source="npd",
                        node=self.node,
                        where=self.where,
                        observed_time=now,
                        severity="critical",
                        lines=[json.dumps(condition, sort_keys=True, default=str)[:2000]],
                        labels={"reason": reason, "type": str(condition.get("type"))},
                    ),
                )
            )
        self._last = findings
        return findings

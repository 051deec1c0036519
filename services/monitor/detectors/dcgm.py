"""DCGM fields as dcgm-exporter exposes them (R1): double-bit ECC errors, row remapping and
thermal throttling.

    DCGM_FI_DEV_ECC_DBE_VOL_TOTAL{gpu="0",UUID="GPU-...",pci_bus_id="00000000:3B:00.0",...} 2
    DCGM_FI_DEV_ROW_REMAP_FAILURE{gpu="0",...} 1
    DCGM_FI_DEV_ROW_REMAP_PENDING{gpu="0",...} 1
    DCGM_FI_DEV_THERMAL_VIOLATION{gpu="0",...} 123456   (microseconds throttled, a counter)
    DCGM_FI_DEV_CLOCKS_EVENT_REASONS{gpu="0",...} 64     (bit 0x20 SW, 0x40 HW thermal slowdown)

Sans-I/O: `Dcgm.observe(text, now)` with the exporter's text; thermal throttling is a rate, so
the detector keeps the previous sample per GPU."""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime

from libs.contracts.remediation import AlertKind, Evidence, Finding, Severity
from libs.faults.catalog import KINDS
from services.monitor.detectors import prom

DBE_VOLATILE = "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"
ROW_REMAP_FAILURE = "DCGM_FI_DEV_ROW_REMAP_FAILURE"
ROW_REMAP_PENDING = "DCGM_FI_DEV_ROW_REMAP_PENDING"
THERMAL_VIOLATION = "DCGM_FI_DEV_THERMAL_VIOLATION"
THROTTLE_REASONS = ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS")
THERMAL_BITS = 0x20 | 0x40  # SW and HW thermal slowdown
FIELDS = {DBE_VOLATILE, ROW_REMAP_FAILURE, ROW_REMAP_PENDING, THERMAL_VIOLATION, *THROTTLE_REASONS}


def gpu_subject(labels: dict[str, str]) -> str:
    """The GPU's PCI address when the exporter gives it (as the kernel log names GPUs), else
    its index."""
    bus_id = labels.get("pci_bus_id") or labels.get("PCI_BUS_ID") or ""
    if bus_id:
        bus_id = bus_id.lower()
        if len(bus_id) == 16 and bus_id.startswith("0000"):  # 00000000:3b:00.0
            bus_id = bus_id[4:]
        if len(bus_id) == 12 and bus_id[10] == ".":
            bus_id = bus_id[:10]
        return bus_id
    return f"gpu{labels.get('gpu', '?')}"


@dataclass(slots=True)
class _Thermal:
    time: datetime
    violation_us: float


class Dcgm:
    def __init__(
        self,
        node: str,
        where: str,
        thermal_fraction: float = 0.2,
    ) -> None:
        self.node = node
        self.where = where
        self.thermal_fraction = thermal_fraction  # share of time throttled that is a fault
        self.malformed = 0
        self._thermal: dict[str, _Thermal] = {}

    def observe(self, text: str, now: datetime) -> list[Finding]:
        exposition = prom.parse(text)
        self.malformed += exposition.malformed
        by_gpu: dict[str, dict[str, prom.Sample]] = {}
        for sample in exposition.samples:
            if sample.name in FIELDS:
                if math.isnan(sample.value) or math.isinf(sample.value):
                    self.malformed += 1
                    continue
                by_gpu.setdefault(gpu_subject(sample.labels), {})[sample.name] = sample
        findings: list[Finding] = []
        for gpu, fields in sorted(by_gpu.items()):
            findings.extend(self._gpu(gpu, fields, now))
        return findings

    def _gpu(self, gpu: str, fields: dict[str, prom.Sample], now: datetime) -> list[Finding]:
        found = []
        dbe = fields.get(DBE_VOLATILE)
        if dbe is not None and dbe.value > 0:
            found.append(self._finding(AlertKind.ECC_DOUBLE_BIT, gpu, [dbe], now))
        failure = fields.get(ROW_REMAP_FAILURE)
        if failure is not None and failure.value > 0:
            found.append(self._finding(AlertKind.ROW_REMAP_FAILURE, gpu, [failure], now))
        pending = fields.get(ROW_REMAP_PENDING)
        if pending is not None and pending.value > 0:
            found.append(self._finding(AlertKind.ROW_REMAP_PENDING, gpu, [pending], now))
        thermal = self._thermal_samples(gpu, fields, now)
        if thermal:
            found.append(self._finding(AlertKind.THERMAL_THROTTLING, gpu, thermal, now))
        return found

    def _thermal_samples(
        self, gpu: str, fields: dict[str, prom.Sample], now: datetime
    ) -> list[prom.Sample]:
        evidence: list[prom.Sample] = []
        for name in THROTTLE_REASONS:
            reasons = fields.get(name)
            if reasons is not None and int(reasons.value) & THERMAL_BITS:
                evidence.append(reasons)
        violation = fields.get(THERMAL_VIOLATION)
        if violation is not None:
            before = self._thermal.get(gpu)
            self._thermal[gpu] = _Thermal(now, violation.value)
            if before is not None and violation.value >= before.violation_us:
                elapsed_us = (now - before.time).total_seconds() * 1e6
                if (
                    elapsed_us > 0
                    and (violation.value - before.violation_us) / elapsed_us
                    >= self.thermal_fraction
                ):
                    evidence.append(violation)
        return evidence

    def _finding(
        self, kind: AlertKind, gpu: str, samples: list[prom.Sample], now: datetime
    ) -> Finding:
        severity: Severity = KINDS[kind].severity
        labels = {k: v for k, v in samples[0].labels.items() if k in ("gpu", "UUID", "modelName")}
        labels["gpu"] = labels.get("gpu", gpu)
        return Finding(
            kind=kind,
            subject=gpu,
            severity=severity,
            detail=", ".join(f"{s.name}={s.value:g}" for s in samples),
            evidence=Evidence(
                kind=kind,
                source="dcgm",
                node=self.node,
                where=self.where,
                observed_time=now,
                severity=severity,
                lines=[s.line for s in samples],
                values={s.name: s.value for s in samples},
                labels=labels,
            ),
        )

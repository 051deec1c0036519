"""The Prometheus text exposition format (what dcgm-exporter serves), parsed without I/O."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_LINE = 8192


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float
    line: str


@dataclass(slots=True)
class Exposition:
    samples: list[Sample] = field(default_factory=list)
    malformed: int = 0


def _is_name_char(ch: str, first: bool) -> bool:
    if ch.isascii() and (ch.isalpha() or ch in "_:"):
        return True
    return not first and ch.isascii() and ch.isdigit()


class _Malformed(Exception):
    pass


def _parse_labels(line: str, pos: int) -> tuple[dict[str, str], int]:
    """From just after '{' to just after the matching '}'."""
    labels: dict[str, str] = {}
    n = len(line)
    while True:
        while pos < n and line[pos] in " \t":
            pos += 1
        if pos < n and line[pos] == "}":
            return labels, pos + 1
        start = pos
        while pos < n and _is_name_char(line[pos], pos == start):
            pos += 1
        key = line[start:pos]
        if not key:
            raise _Malformed
        while pos < n and line[pos] in " \t":
            pos += 1
        if pos >= n or line[pos] != "=":
            raise _Malformed
        pos += 1
        while pos < n and line[pos] in " \t":
            pos += 1
        if pos >= n or line[pos] != '"':
            raise _Malformed
        pos += 1
        value: list[str] = []
        while True:
            if pos >= n:
                raise _Malformed
            ch = line[pos]
            if ch == "\\":
                if pos + 1 >= n:
                    raise _Malformed
                escaped = line[pos + 1]
                value.append({"n": "\n", "\\": "\\", '"': '"'}.get(escaped, "\\" + escaped))
                pos += 2
                continue
            if ch == '"':
                pos += 1
                break
            value.append(ch)
            pos += 1
        labels[key] = "".join(value)
        while pos < n and line[pos] in " \t":
            pos += 1
        if pos < n and line[pos] == ",":
            pos += 1
            continue
        if pos < n and line[pos] == "}":
            return labels, pos + 1
        raise _Malformed


def _parse_value(text: str) -> float:
    lowered = text.lower()
    if lowered in ("nan",):
        return math.nan
    if lowered in ("+inf", "inf"):
        return math.inf
    if lowered == "-inf":
        return -math.inf
    try:
        return float(text)
    except ValueError:
        raise _Malformed from None


def parse_line(line: str) -> Sample | None:
    """One sample line; None for comments and blank lines; raises _Malformed otherwise."""
    stripped = line.strip()
    if not stripped or stripped.startswith("#"):
        return None
    if len(stripped) > MAX_LINE:
        raise _Malformed
    pos = 0
    n = len(stripped)
    while pos < n and _is_name_char(stripped[pos], pos == 0):
        pos += 1
    name = stripped[:pos]
    if not name:
        raise _Malformed
    labels: dict[str, str] = {}
    if pos < n and stripped[pos] == "{":
        labels, pos = _parse_labels(stripped, pos + 1)
    rest = stripped[pos:].split()
    if not rest or len(rest) > 2 or (pos < n and stripped[pos] not in " \t"):
        raise _Malformed
    value = _parse_value(rest[0])
    if len(rest) == 2:
        try:
            int(rest[1])
        except ValueError:
            raise _Malformed from None
    return Sample(name, labels, value, stripped)


def parse(text: str) -> Exposition:
    """Every sample of an exposition; malformed lines are skipped and counted (S3)."""
    result = Exposition()
    for line in text.splitlines():
        try:
            sample = parse_line(line)
        except _Malformed:
            result.malformed += 1
            continue
        if sample is not None:
            result.samples.append(sample)
    return result

"""How the CLI prints: tables, JSON, YAML and kubectl-style JSONPath templates."""

from __future__ import annotations

import json
import re
from typing import Any

import yaml
from jsonpath_ng.exceptions import JsonPathLexerError, JsonPathParserError
from jsonpath_ng.ext.parser import parse as parse_jsonpath

from libs.contracts.errors import ErrorCode, NodusError

_TEMPLATE_EXPR = re.compile(r"\{([^{}]*)\}")


def to_json(data: Any) -> str:
    return json.dumps(data, indent=2, default=str)


def to_yaml(data: Any) -> str:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


def _scalar(value: Any) -> str:
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(",", ":"), default=str)
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def jsonpath(template: str, data: Any) -> str:
    """kubectl's template form: text with `{.path}` expressions, e.g. '{.status.gang.probe}'."""
    if not _TEMPLATE_EXPR.search(template):
        template = "{" + template + "}"

    def render(match: re.Match[str]) -> str:
        expr = match.group(1).strip()
        if expr.startswith("."):
            expr = "$" + expr
        elif not expr.startswith("$"):
            expr = "$." + expr
        try:
            found = parse_jsonpath(expr).find(data)
        except (JsonPathLexerError, JsonPathParserError, Exception) as error:
            raise NodusError(
                ErrorCode.INVALID, f"bad jsonpath {match.group(0)!r}: {error}"
            ) from None
        return " ".join(_scalar(item.value) for item in found)

    return _TEMPLATE_EXPR.sub(render, template)


def table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    lines = ["   ".join(h.ljust(widths[i]) for i, h in enumerate(headers)).rstrip()]
    for row in rows:
        lines.append("   ".join(cell.ljust(widths[i]) for i, cell in enumerate(row)).rstrip())
    return "\n".join(lines)

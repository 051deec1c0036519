"""Every bucket, stream, subject and default address is spelled once, in libs/contracts/names.py:
a literal of one anywhere else in the product (app, libs, services) fails here, naming the file
and line. Docstrings may show a subject's shape; code may not spell one."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from libs.contracts import names

ROOT = Path(__file__).resolve().parents[2]
NAMES_MODULE = ROOT / "libs" / "contracts" / "names.py"
BUCKETS = {value for key, value in vars(names).items() if key.startswith("BUCKET_")}
STREAMS = {names.EVENTS_STREAM, names.USAGE_STREAM}
SUBJECT_PREFIXES = ("nodus.api.", "nodus.evt.", "nodus.usage.", "nodus.node.", "nodus.gang.")
ADDRESSES = (names.SOCKS_ENDPOINT, f":{names.NATS_PORT}")


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the constants that are docstrings (a module's, a class's, a function's)."""
    found: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                found.add(id(value))
    return found


def _spelled(text: str) -> str | None:
    """What `text` spells that only names.py may."""
    if text in BUCKETS or text in STREAMS:
        return text
    if text.startswith(SUBJECT_PREFIXES):
        return text
    return next((a for a in ADDRESSES if a in text), None)


def literals(path: Path) -> Iterator[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    docstrings = _docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and id(node) not in docstrings:
            if isinstance(node.value, str) and (spelled := _spelled(node.value)):
                yield node.lineno, spelled
            elif node.value == names.NATS_PORT and not isinstance(node.value, bool):
                yield node.lineno, str(node.value)


def product_files() -> Iterator[Path]:
    for top in ("app", "libs", "services"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if path != NAMES_MODULE:
                yield path


def test_no_bucket_stream_subject_or_default_address_is_spelled_outside_names() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{line}: {spelled!r}"
        for path in product_files()
        for line, spelled in literals(path)
    ]
    assert found == [], "spell these through libs.contracts.names:\n" + "\n".join(found)


def test_the_check_finds_a_literal_subject_bucket_and_address(tmp_path: Path) -> None:
    """The scan above is not vacuous: each kind of literal it forbids is found."""
    sample = tmp_path / "sample.py"
    sample.write_text(
        '"""A docstring may say nodus.evt.job.<org>.<name>.<kind>."""\n'
        'BUCKET = "nodus-jobs"\n'
        'SUBJECT = f"nodus.usage.{1}.>"\n'
        'SOCKS = "127.0.0.1:1080"\n'
        "PORT = 4222\n"
    )
    assert sorted(line for line, _ in literals(sample)) == [2, 3, 4, 5]


def test_every_agent_verb_is_a_subject_token() -> None:
    for verb in names.AgentVerb:
        assert names.node_request("n", verb) == f"nodus.node.n.req.{verb.value}"

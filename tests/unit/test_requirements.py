"""Every requirement id a comment, docstring or document of the project cites (`G7`, `R17`,
`S4`, `G10.3`) is defined in docs/requirements.md, so a reader can look it up."""

from __future__ import annotations

import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = ROOT / "docs" / "requirements.md"
CITED = re.compile(r"\b([DGCTRSO][1-9][0-9]?(?:\.[1-9])?)\b")
REQUIREMENT = re.compile(r"^- ([DGCTRSO][1-9][0-9]?)\.(.*?)(?=^- |^#|\Z)", re.M | re.S)
PART = re.compile(r"\(([1-9])\)")  # a requirement's numbered parts, cited as `G10.3`


def defined() -> set[str]:
    ids: set[str] = set()
    for requirement, text in REQUIREMENT.findall(REQUIREMENTS.read_text()):
        ids.add(requirement)
        ids |= {f"{requirement}.{part}" for part in PART.findall(text)}
    return ids


def python_prose(text: str) -> Iterator[tuple[int, str]]:
    """Comments and string literals (docstrings, messages): where a citation can be."""
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT or (
            token.type == tokenize.STRING and not token.string.lower().startswith(("b", "rb"))
        ):
            yield token.start[0], token.string
        elif getattr(tokenize, "FSTRING_MIDDLE", None) == token.type:
            yield token.start[0], token.string


def citations() -> Iterator[tuple[Path, int, str]]:
    tops = ("app", "libs", "services", "tests", "netshim/src", "deploy", "docs", "examples")
    files = [ROOT / "README.md"] + [p for top in tops for p in sorted((ROOT / top).rglob("*"))]
    for path in files:
        if path in (REQUIREMENTS, Path(__file__)) or not path.is_file():
            continue
        if path.suffix == ".py":
            prose = python_prose(path.read_text())
        elif path.suffix in (".md", ".c", ".h", ".yaml", ".yml", ".service", ".sh"):
            prose = enumerate(path.read_text().splitlines(), 1)
        else:
            continue
        for line, text in prose:
            for cited in CITED.findall(text):
                yield path, line, cited


def test_every_cited_requirement_is_defined() -> None:
    known = defined()
    unknown = [
        f"{path.relative_to(ROOT)}:{line}: {cited}"
        for path, line, cited in citations()
        if cited not in known
    ]
    assert unknown == [], "cited, not in docs/requirements.md:\n" + "\n".join(unknown)


def test_the_page_defines_every_part_of_the_spec() -> None:
    known = defined()
    assert {"D1", "G1", "G22", "C7", "T2", "R18", "S4", "O5", "G10.3"} <= known
    assert "G23" not in known

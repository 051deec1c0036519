"""The house rules DESIGN.md states, checked on the code: every record (a msgspec Struct) is
defined in libs/contracts, where every program reads it; no service imports another service's
modules (they talk over the bus); libs never import services or the application."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONTRACTS = ROOT / "libs" / "contracts"


def sources(*tops: str) -> Iterator[tuple[Path, ast.Module]]:
    for top in tops:
        for path in sorted((ROOT / top).rglob("*.py")):
            yield path, ast.parse(path.read_text(), str(path))


def _is_record(base: ast.expr) -> bool:
    name = ast.unparse(base)
    return name in ("msgspec.Struct", "Struct", "Record")


def test_every_record_is_defined_in_libs_contracts() -> None:
    outside = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"
        for path, tree in sources("app", "libs", "services")
        if not path.is_relative_to(CONTRACTS)
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and any(_is_record(b) for b in node.bases)
    ]
    assert outside == [], "records belong in libs/contracts:\n" + "\n".join(outside)


def _imports(tree: ast.Module) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.lineno, node.module
        elif isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)


def test_no_service_imports_another_and_libs_import_neither_services_nor_app() -> None:
    crossings = []
    for path, tree in sources("services", "libs"):
        parts = path.relative_to(ROOT).parts
        for line, module in _imports(tree):
            target = module.split(".")
            where = f"{path.relative_to(ROOT)}:{line} imports {module}"
            if parts[0] == "libs" and target[0] in ("services", "app"):
                crossings.append(where)
            elif parts[0] == "services" and target[0] == "services" and target[1] != parts[1]:
                crossings.append(where)
            elif parts[0] == "services" and target[0] == "app":
                crossings.append(where)
    assert crossings == [], "\n".join(crossings)


def _walk(section: str) -> tuple[list[str], set[str]]:
    """A walkthrough of docs/architecture.md: the file each numbered step opens, and every
    file it names by its full path (steps it hands off to inside another step)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    start = text.index(section)
    end = text.find("\n### ", start + 1)
    body = text[start : end if end != -1 else text.index("\n## ", start)]
    steps = re.findall(r"^\d+\. `([^`]+)`", body, flags=re.MULTILINE)
    named = set(re.findall(r"`((?:app|services|netshim)/[^`]+\.(?:py|c))`", body))
    return steps, named


def test_a_job_is_followed_in_few_files_that_exist() -> None:
    """A newcomer follows a Private job in at most 12 files, a Relayed one in at most 16
    (it shares steps 1, 2, 4, 5, 6 and 7 of the Private walk), and every file named exists."""
    private, named_private = _walk("### A Private job")
    relayed, named_relayed = _walk("### A Relayed job")
    shared = {private[i] for i in (0, 1, 3, 4, 5, 6)}
    assert len(set(private) | named_private) <= 12, sorted(set(private) | named_private)
    assert len(shared | set(relayed) | named_relayed) <= 16, sorted(shared | set(relayed))
    missing = [p for p in {*private, *relayed, *named_relayed} if not (ROOT / p).exists()]
    assert missing == [], f"docs/architecture.md names files that do not exist: {missing}"


def test_no_source_file_over_600_lines_and_no_class_over_25_methods() -> None:
    """Rooms stay readable (issue 24): a file a newcomer opens fits in one sitting."""
    long_files, big_classes = [], []
    for path, tree in sources("app", "libs", "services", "tests"):
        lines = len(path.read_text().splitlines())
        if lines > 600:
            long_files.append(f"{path.relative_to(ROOT)}: {lines} lines")
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                methods = [
                    f for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                ]
                if len(methods) > 25:
                    big_classes.append(f"{path.relative_to(ROOT)}:{node.name} {len(methods)}")
    assert long_files == [] and big_classes == [], long_files + big_classes

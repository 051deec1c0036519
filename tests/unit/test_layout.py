"""The house rules DESIGN.md states, checked on the code: every record (a msgspec Struct) is
defined in libs/contracts, where every program reads it; no service imports another service's
modules (they talk over the bus); libs never import services or the application."""

from __future__ import annotations

import ast
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

"""End-to-end fixtures: after every test, no daemon log holds an error (tests/e2e/daemon_logs.py).

Every `LocalSystem` a test (or a module fixture) starts is watched by itself; a system started
as `nodus up` in a subprocess is watched with `daemon_logs.watch(STATE_DIR / "logs")`. Lines
written while a test runs are that test's; lines written while a module-scoped system starts
belong to the module's first test, and lines written while it stops fail the module's teardown.
Where an error is the point of a test:

    @pytest.mark.daemon_logs_allow(r"relay relay-0 refused", r"^cannot start")
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from app.local import LocalSystem
from tests.e2e.daemon_logs import DaemonLogs, disallowed, report

MARKER = "daemon_logs_allow"


def allowed_patterns(node: pytest.Item | pytest.Collector) -> list[str]:
    return [str(p) for mark in node.iter_markers(MARKER) for p in mark.args]


@pytest.fixture(scope="session")
def daemon_logs() -> Iterator[DaemonLogs]:
    """The watched log directories; every LocalSystem.start adds its own."""
    logs = DaemonLogs()
    original = LocalSystem.start

    async def start(self: LocalSystem, *args: Any, **kwargs: Any) -> None:
        logs.watch(self.state_dir / "logs")
        await original(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(LocalSystem, "start", start)
        yield logs


@pytest.fixture(scope="module", autouse=True)
def _daemon_logs_of_the_module(
    request: pytest.FixtureRequest, daemon_logs: DaemonLogs
) -> Iterator[None]:
    """Set up before the module's own fixtures, torn down after them: sees systems stop."""
    yield
    found = disallowed(daemon_logs.read_new(), allowed_patterns(request.node))
    if found:
        pytest.fail(report(found, f"after the last test of {request.node.name}"), pytrace=False)


@pytest.fixture(autouse=True)
def _daemon_logs_of_the_test(
    request: pytest.FixtureRequest, daemon_logs: DaemonLogs
) -> Iterator[None]:
    yield
    found = disallowed(daemon_logs.read_new(), allowed_patterns(request.node))
    if found:
        pytest.fail(report(found, "after this test"), pytrace=False)

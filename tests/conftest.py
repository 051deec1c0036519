"""Fixtures: a real nats-server with JetStream per test, the bus, and an in-process placer."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest

from libs.bus import Bus
from libs.bus.server import NatsServer
from libs.contracts import names
from libs.contracts.jobs import ConditionType, Job, Phase
from libs.contracts.placer import PlacerConfig
from services.placer.config import load_config
from services.placer.service import Placer
from tests import bus_operator, figures

# A lab waits for the host's route while a lab of another run holds it (a CI machine that runs
# jobs side by side on one host network), up to 5 minutes, instead of failing at once; the
# benches run as subprocesses and inherit it.
os.environ.setdefault("NODUS_LAB_ROUTE_WAIT", "300")


@pytest.fixture(scope="session", autouse=True)
def operator_credentials(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Authentication is on in every test (S1): the tests' own clients are the operator,
    whose seed every bus a test starts admits; the processes the lab starts get their own."""
    with bus_operator.operator_credentials(tmp_path_factory.mktemp("operator")) as seed:
        yield seed


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path / "nats").start()
    yield server
    server.stop()


@pytest.fixture
async def bus(nats_server: NatsServer) -> AsyncIterator[Bus]:
    opened = await Bus.open(nats_server.url, name="test", buckets=names.ALL_BUCKETS, streams=True)
    yield opened
    await opened.close()


@pytest.fixture
def placer_config() -> PlacerConfig:
    config = load_config()
    config.distributed_access = ["acme", "globex", "initech"]
    config.takeover_seconds = 0.5
    return config


StartPlacer = Callable[..., Awaitable[Placer]]


@pytest.fixture
async def start_placer(
    nats_server: NatsServer, placer_config: PlacerConfig
) -> AsyncIterator[StartPlacer]:
    """Start placers in-process, each on its own connection, as separate replicas would be."""
    started: list[tuple[Placer, Bus]] = []

    async def start(config: PlacerConfig | None = None, replica: str | None = None) -> Placer:
        placer_bus = await Bus.open(
            nats_server.url, name="placer", buckets=names.ALL_BUCKETS, streams=True
        )
        placer = Placer(placer_bus, config or placer_config, replica=replica)
        await placer.start()
        started.append((placer, placer_bus))
        return placer

    yield start
    for placer, placer_bus in started:
        await placer.stop()
        await placer_bus.close()


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float = 10.0) -> None:
    """Poll `check` until it holds; fail with a clear message when it never does."""
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        if await check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"condition {check.__name__} did not hold within {timeout}s")


async def placed(bus: Bus, key: str, timeout: float = 10.0) -> Job:
    """The job once it says Placed."""
    jobs = bus.bucket(names.BUCKET_JOBS, Job)
    found: list[Job] = []

    async def is_placed() -> bool:
        current = await jobs.get(key)
        if current is not None and current.value.status.phase is Phase.PLACED:
            found.append(current.value)
            return True
        return False

    await eventually(is_placed, timeout)
    return found[-1]


async def until_gang_ready_says(bus: Bus, key: str, reason: str, timeout: float = 10.0) -> None:
    """Until the job's GangReady condition gives `reason` (Unschedulable, IPCollision, ...)."""
    jobs = bus.bucket(names.BUCKET_JOBS, Job)

    async def says() -> bool:
        current = await jobs.get(key)
        ready = current.value.condition(ConditionType.GANG_READY) if current else None
        return ready is not None and ready.reason == reason

    says.__name__ = f"{key} GangReady {reason}"
    await eventually(says, timeout)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """The figures this run measured, in the log (and in .nodus/figures.json)."""
    text = figures.write()
    if text is not None:
        terminalreporter.write_sep("=", f"figures measured (also in {figures.FILE})")
        terminalreporter.write_line(text)


def children() -> set[int]:
    """This process's child processes, living or not yet reaped (a test that none is left)."""
    found: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        found |= {int(pid) for pid in (task / "children").read_text().split()}
    return found


async def left_when_cancelled(work: Coroutine[Any, Any, object]) -> set[int]:
    """Run `work` until it has started a child process, cancel it, and say which of its
    children are still there (a daemon stopping must leave none)."""
    before = children()
    task = asyncio.create_task(work)
    for _ in range(200):
        if children() - before:
            break
        await asyncio.sleep(0.025)
    assert children() - before, "its process never started"
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return children() - before

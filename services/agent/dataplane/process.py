"""One epoch's dataplane in a process of its own (O4, G13-G15): the Relayed tunnel with its
SOCKS5 entry, or the Direct `nodus0` with ICE and its relay fallback. The agent starts it (a
session of its own, so it outlives the agent), watches it and re-adopts it when the agent
starts again; the TCP connections inside the tunnel never notice an agent restart.

It reads what to run from its epoch's state directory (services/agent/dataplane/store.py),
connects to the bus as the agent's own user (it touches only its node's and its epoch's
subjects, S1), answers the agent on its control socket, and ends on SIGTERM, on a stop
request, or when its join key is deleted (the epoch was fenced while no agent watched).

    python -m services.agent.dataplane --epoch-dir STATE/epochs/KEY --nats URL \\
        [--credentials SEED]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Iterable
from pathlib import Path

import uvloop
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.metrics_core import Metric

from libs.bus import Bus
from libs.bus.auth import AGENT_BUCKETS, agent_inbox
from libs.contracts import names
from libs.contracts.dataplane import (
    ControlReply,
    ControlRequest,
    MetricsRequest,
    PathRequest,
    StatusRequest,
    StopRequest,
)
from libs.contracts.epochs import JoinKeyGrant
from libs.contracts.errors import ErrorCode, NodusError
from libs.runtime.service import STOP_SIGNALS, configure_logging, hold_stop_signals
from libs.runtime.tasks import TaskSet
from services.agent.dataplane.control import serve
from services.agent.dataplane.inline import InlineDataplane
from services.agent.dataplane.store import EpochStore

log = logging.getLogger("nodus.agent.dataplane")

OWN_METRICS = "nodus_agent_"  # the dataplane's families; the bus client's are the agent's
FAILED = 3  # exit status: the dataplane could not start (the agent tries again later)


class _OwnMetrics:
    """The dataplane's metric families only, for the agent to re-expose on its /metrics."""

    def collect(self) -> Iterable[Metric]:
        return (f for f in REGISTRY.collect() if f.name.startswith(OWN_METRICS))


class DataplaneProcess:
    def __init__(self, epoch_dir: Path, bus: Bus) -> None:
        store = self.store = EpochStore(epoch_dir.parent.parent)
        self.stored = store.load(epoch_dir.name)
        self.socket = store.socket(epoch_dir.name)
        self.bus = bus
        state = self.stored.state
        if state.dataplane is None:
            raise NodusError(ErrorCode.INVALID, f"{state.key}: no dataplane to run")
        self.dataplane = InlineDataplane.build(bus, state, self.stored.wg_private)
        self.stop = asyncio.Event()
        self.failed = ""
        self._tasks = TaskSet("dataplane", log)

    async def handle(self, request: ControlRequest) -> ControlReply:
        if isinstance(request, StatusRequest):
            home = self.dataplane.home_now()
            return ControlReply(
                ready=self.dataplane.ready,
                failed=self.failed,
                path=home[0] if home else None,
                relay=home[1] if home else None,
            )
        if isinstance(request, PathRequest):
            return ControlReply(path=await self.dataplane.path_to(request.peer, request.wait))
        if isinstance(request, MetricsRequest):
            return ControlReply(metrics=generate_latest(_OwnMetrics()).decode())
        if isinstance(request, StopRequest):
            self.stop.set()
            return ControlReply()
        raise NodusError(ErrorCode.INVALID, f"unknown control request {request!r}")

    async def run(self) -> int:
        state = self.stored.state
        server = await serve(self.socket, self.handle)
        self._tasks.spawn(self._fenced(state.key), name="join key")
        starting = asyncio.ensure_future(self.dataplane.start())
        stopping = asyncio.ensure_future(self.stop.wait())
        try:
            await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if starting.done() and starting.exception() is not None:
                error = starting.exception()
                if not isinstance(error, NodusError | OSError | TimeoutError):
                    raise error  # type: ignore[misc]
                self.failed = str(error) or repr(error)
                self.store.save_failure(state.key, self.failed)  # the agent says it
                log.warning(
                    "%s epoch %d: the dataplane did not start: %s",
                    state.joined.gang,
                    state.joined.epoch,
                    self.failed,
                )
                return FAILED
            await self.stop.wait()
            log.info("%s epoch %d: the dataplane stops", state.joined.gang, state.joined.epoch)
            return 0
        finally:
            stopping.cancel()
            if not starting.done():
                # Awaited here: a start cancelled and left running would still be reading the
                # bus when the process closes it (ConnectionDrainingError, never retrieved).
                starting.cancel()
                await asyncio.gather(starting, return_exceptions=True)
            server.close()
            await self._tasks.close()
            try:
                await self.dataplane.stop()
            except (NodusError, OSError, RuntimeError) as error:  # the namespace went first
                log.warning("%s: the dataplane did not stop cleanly: %s", state.key, error)
            self.socket.unlink(missing_ok=True)

    async def _fenced(self, key: str) -> None:
        """The join key deleted: the epoch is over (fenced, ended) even if no agent runs to
        say so; a member left on it must not stay reachable (G9)."""
        grants = self.bus.bucket(names.BUCKET_JOINKEYS, JoinKeyGrant)
        async for change in grants.watch(key):
            if change.value is None or (change.value.epoch and change.value.epoch.fenced):
                log.info("%s: the join key is gone; the epoch is over here", key)
                self.stop.set()
                return


async def _main(args: argparse.Namespace) -> int:
    os.umask(0o077)
    epoch_dir: Path = args.epoch_dir.resolve()
    stored = EpochStore(epoch_dir.parent.parent).load(epoch_dir.name)
    node = stored.state.joined
    bus = await Bus.open(
        args.nats,
        name=f"nodus-dataplane-{epoch_dir.name}",
        credentials=args.credentials,
        buckets=AGENT_BUCKETS,
        inbox_prefix=agent_inbox(stored.state.dataplane.node if stored.state.dataplane else ""),
        confined=True,
    )
    try:
        process = DataplaneProcess(epoch_dir, bus)
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, process.stop.set)
        log.info("dataplane of %s epoch %d starts (pid %d)", node.gang, node.epoch, os.getpid())
        return await process.run()
    finally:
        hold_stop_signals()  # the agent's SIGTERM to one that ended by itself: it stops anyway
        await bus.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m services.agent.dataplane",
        description="One gang epoch's dataplane, started and re-adopted by the node's agent.",
    )
    parser.add_argument("--epoch-dir", type=Path, required=True, help="STATE/epochs/<key>")
    parser.add_argument("--nats", required=True, help="the bus URL (the agent's)")
    parser.add_argument("--credentials", help="the agent's bus credentials")
    args = parser.parse_args(argv)
    configure_logging(
        "dataplane",
        os.environ.get("NODUS_LOG_LEVEL", "INFO"),
        os.environ.get("NODUS_LOG_FORMAT", "json"),
    )
    try:
        return uvloop.run(_main(args))
    except NodusError as error:
        log.warning("the dataplane cannot run: %s", error)
        return FAILED
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())

"""A daemon's main: `run_daemon(args, body)` where `body(stop)` returns once `stop` is set."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import uvloop
from prometheus_client import start_http_server

from libs.bus.connection import DEFAULT_URL, default_credentials, default_url
from libs.contracts.errors import NodusError

Body = Callable[[argparse.Namespace, asyncio.Event], Awaitable[None]]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def hold_stop_signals() -> None:
    """Stopping already: a further SIGTERM or SIGINT stays pending, blocked, and ends with the
    process. Left to the loop, one that came as its handler was put back to the default (the
    loop closing, or the handler removed) printed "Signal 15 ignored due to race condition";
    a blocked one is never caught at all. SIGKILL still ends a process that hangs stopping."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def release_stop_signals() -> None:
    """Undo `hold_stop_signals` (before an exec: the mask outlives it): one held meanwhile
    now ends the process, as it asked."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def add_bus_flags(parser: argparse.ArgumentParser) -> None:
    """How a daemon or a client command reaches the bus."""
    parser.add_argument(
        "--nats",
        default=default_url(),
        help=f"bus URL (env NODUS_NATS_URL; default {DEFAULT_URL})",
    )
    parser.add_argument(
        "--credentials",
        default=default_credentials(),
        help="this process's bus credentials: an NKey seed file (nats.nk) or a NATS .creds "
        "file (env NODUS_CREDENTIALS)",
    )


def add_common_flags(parser: argparse.ArgumentParser, metrics_port: int = 0) -> None:
    """Flags every daemon takes; each falls back to an environment variable."""
    add_bus_flags(parser)
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=int(os.environ.get("NODUS_METRICS_PORT", metrics_port)),
        help="serve Prometheus /metrics on this port; 0 disables (env NODUS_METRICS_PORT)",
    )
    parser.add_argument(
        "--metrics-host",
        default=os.environ.get("NODUS_METRICS_HOST", "127.0.0.1"),
        help="address for /metrics (env NODUS_METRICS_HOST; default 127.0.0.1)",
    )
    parser.add_argument(
        "--log-level",
        default=os.environ.get("NODUS_LOG_LEVEL", "INFO"),
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="(env NODUS_LOG_LEVEL)",
    )
    parser.add_argument(
        "--log-format",
        default=os.environ.get("NODUS_LOG_FORMAT", "json"),
        choices=["json", "text"],
        help="json lines for journald and log shippers, or text (env NODUS_LOG_FORMAT)",
    )


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        extra = getattr(record, "fields", None)
        if isinstance(extra, dict):
            line.update(extra)
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure_logging(service: str, level: str = "INFO", fmt: str = "json") -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(service))
    else:
        handler.setFormatter(logging.Formatter(f"%(asctime)s {service} %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("nats").setLevel(max(logging.WARNING, root.level))


class RestartProcess(Exception):
    """Raised by a daemon's body once it stopped cleanly: run it again from the start."""


def run_daemon(service: str, args: argparse.Namespace, body: Body) -> int:
    """Run `body` under uvloop until SIGTERM/SIGINT; a NodusError at start is a clear exit 1."""
    configure_logging(service, args.log_level, args.log_format)
    log = logging.getLogger(f"nodus.{service}")
    if args.metrics_port:
        start_http_server(args.metrics_port, addr=args.metrics_host)
        log.info("metrics on http://%s:%d/metrics", args.metrics_host, args.metrics_port)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, stop.set)
        try:
            await body(args, stop)
        finally:
            hold_stop_signals()

    try:
        uvloop.run(main())
    except RestartProcess as restart:
        # The same program again, in this process (same PID, logs and namespace): what a
        # machine's boot does to its daemons, for the lab's machine provider (issue 13).
        log.info("restarting: %s", restart)
        logging.shutdown()
        release_stop_signals()
        os.execv(sys.executable, sys.orig_argv)
    except NodusError as error:
        log.error("cannot start: %s", error)
        print(f"nodus {service}: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        pass
    log.info("stopped")
    return 0

"""A standalone SOCKS5 endpoint that dials directly: what the shim's tests and bench talk to.

    python -m libs.socks5 --listen 127.0.0.1:0 --events events.jsonl

Prints `listening HOST:PORT` on stdout once it accepts connections, writes one JSON line per
connection event (connected, closed, rejected; see libs.socks5.server) to --events, and
runs until SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import sys
from typing import IO

import msgspec

from libs.contracts.names import SOCKS_ENDPOINT
from libs.socks5.server import SocksEvent, serve


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m libs.socks5", description=__doc__.split("\n")[0]
    )
    parser.add_argument(
        "--listen", default=SOCKS_ENDPOINT, help="HOST:PORT, [V6]:PORT; port 0 = any"
    )
    parser.add_argument(
        "--events", help="append connection events here as JSON lines ('-': stdout)"
    )
    parser.add_argument("--dial-timeout", type=float, default=20.0, help="seconds (reply 6 after)")
    parser.add_argument("--handshake-timeout", type=float, default=10.0, help="seconds")
    parser.add_argument("--no-uvloop", action="store_true", help="use the default asyncio loop")
    return parser.parse_args(argv)


def split_host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise SystemExit(f"--listen: expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


async def main(args: argparse.Namespace, sink: IO[bytes] | None) -> None:
    host, port = split_host_port(args.listen)
    encoder = msgspec.json.Encoder()

    def on_event(event: SocksEvent) -> None:
        if sink is not None:
            sink.write(encoder.encode(event) + b"\n")
            sink.flush()

    server = await serve(
        host,
        port,
        dial_timeout=args.dial_timeout,
        handshake_timeout=args.handshake_timeout,
        on_event=on_event,
    )
    bound = server.sockets[0].getsockname()
    shown = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    print(f"listening {shown}:{bound[1]}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()


def run(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with contextlib.ExitStack() as stack:
        sink: IO[bytes] | None = None
        if args.events == "-":
            sink = sys.stdout.buffer
        elif args.events:
            sink = stack.enter_context(open(args.events, "ab", buffering=0))
        if args.no_uvloop:
            asyncio.run(main(args, sink))
            return
        import uvloop

        with contextlib.suppress(KeyboardInterrupt):
            uvloop.run(main(args, sink))


if __name__ == "__main__":
    run()

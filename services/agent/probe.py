"""The member side of the probe (G10), run by the agent: a server each member runs on its
advertised address (`probeserver.py`), and this client, run as a separate process with the
rank's own environment (`python -m services.agent.probe`), so that its connections take the
path the workload will take (through the shim on the Relayed path). The runner only asks for
it over the bus. The client imports the standard library only: it starts for every pair of
every round, and the package of daemon helpers took 140 ms to import.

Protocol on a probe connection, chosen by its first byte:
    R  readiness: the server answers one byte, then closes.
    P  ping: the server echoes 8-byte messages until the client closes.
    T  throughput: the server reads until EOF and answers the byte count (u64).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import struct
import sys
import time

U64 = struct.Struct(">Q")
CHUNK = 1 << 20


def _connect(address: str, port: int, deadline: float) -> socket.socket:
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            return socket.create_connection(
                (address, port), timeout=max(0.1, deadline - time.monotonic())
            )
        except OSError as error:  # refused while the peer's tunnel comes up: retry, as NCCL does
            last = error
            time.sleep(0.2)
    raise TimeoutError(f"no connection to {address}:{port} within the readiness window: {last}")


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("probe peer closed early")
        data += chunk
    return data


def run_client(
    address: str, port: int, connections: int, seconds: float, readiness: float, measure: bool
) -> dict[str, object]:
    """Readiness (fresh connections, each on a new ephemeral port), then RTT and throughput."""
    result: dict[str, object] = {"connections": 0, "rttMs": 0.0, "tcpGbps": 0.0, "error": None}
    deadline = time.monotonic() + readiness
    try:
        for _ in range(connections):
            with _connect(address, port, deadline) as sock:
                sock.sendall(b"R")
                _recv_exact(sock, 1)
            result["connections"] = int(result["connections"]) + 1  # type: ignore[call-overload]
        if not measure:
            return result
        with _connect(address, port, deadline) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(b"P")
            samples = []
            for i in range(21):
                t0 = time.perf_counter()
                sock.sendall(U64.pack(i))
                _recv_exact(sock, 8)
                samples.append(time.perf_counter() - t0)
            result["rttMs"] = round(statistics.median(samples[1:]) * 1000, 3)
        with _connect(address, port, deadline) as sock:
            sock.sendall(b"T")
            block = bytes(CHUNK)
            sent = 0
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                sock.sendall(block)
                sent += len(block)
            sock.shutdown(socket.SHUT_WR)
            (received,) = U64.unpack(_recv_exact(sock, 8))
            elapsed = time.perf_counter() - t0
            result["tcpGbps"] = round(received * 8 / elapsed / 1e9, 4)
    except (OSError, TimeoutError, ConnectionError) as error:
        result["error"] = f"{type(error).__name__}: {error}"
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="nodus-probe", description="probe one peer (runs with the rank's environment)"
    )
    parser.add_argument("--address", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--connections", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--readiness", type=float, default=60.0)
    parser.add_argument("--no-measure", action="store_true")
    args = parser.parse_args(argv)
    result = run_client(
        args.address, args.port, args.connections, args.seconds, args.readiness, not args.no_measure
    )
    print(json.dumps(result), flush=True)
    return 0 if result["error"] is None else 1


if __name__ == "__main__":
    sys.exit(main())

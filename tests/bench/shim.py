"""Shim benchmark: what redirecting a connection costs, against proxychains4 and direct.

    .venv/bin/python -m tests.bench.shim             # 2,000 connects per path, 1 GiB streams
    .venv/bin/python -m tests.bench.shim --quick     # 200 connects, 64 MiB (smoke)

What runs: one SOCKS5 endpoint (`python -m libs.socks5`, uvloop, on 127.0.0.1), one sink
(`netbench sink`, C, on the "peer" 127.0.0.2), and the C client `netbench` (netshim/tests/)
in four ways, so the figures are the paths' and not an interpreter's:

  direct        no preload: the baseline
  shim_bypass   the shim preloaded, the sink NOT a peer: the cost of the hooks on traffic
                they leave alone (connect compares the address; nothing after connect is hooked)
  shim          the shim preloaded, the sink a peer: through the SOCKS endpoint
  proxychains4  Debian's proxychains4 (-q, strict_chain) on the same endpoint

Connect: N blocking connect() calls per path, each closed at once, in interleaved rounds whose
order rotates (so drift and position hit every path alike); p50, p90, p99 in microseconds. Stream: one connection, BYTES
sent, write side shut, timed until the sink's close comes back (end to end), best of R; GB/s.
The endpoint splices in Python, so shim and proxychains4 streams both measure that splice:
`splice_cost` is direct over via-endpoint throughput, and shim over proxychains4 isolates the
shim (same endpoint, same splice). The endpoint's event log proves which connections it
carried (`carried`): every shim and proxychains4 connect, no direct or bypass one.

Speed is reported, never asserted; stdout carries one JSON object, progress goes to stderr.
Exit status 1 means the run did not complete (a path failed), not that it was slow.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from libs import netshim

REPO = Path(__file__).resolve().parents[2]
PEER = "127.0.0.2"
NOT_A_PEER = "127.0.0.9"  # what shim_bypass lists as peer, so the sink is not one
NETBENCH = netshim.TEST_PROGRAMS / "netbench"
PATHS = ("direct", "shim_bypass", "shim", "proxychains4")


def log(message: str) -> None:
    print(f"[bench.shim] {message}", file=sys.stderr, flush=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.shim", description=__doc__)
    parser.add_argument("--connects", type=int, default=2000, help="connects per path")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds of connects")
    parser.add_argument("--bytes", type=int, default=1 << 30, help="bytes per stream")
    parser.add_argument("--repeats", type=int, default=3, help="streams per path (best kept)")
    parser.add_argument("--quick", action="store_true", help="200 connects, 64 MiB, 1 repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.connects, args.rounds, args.bytes, args.repeats = 200, 4, 64 << 20, 1
    return args


def base_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.lower().endswith("_proxy") and not k.startswith(("NODUS_NETSHIM", "LD_PRELOAD"))
    }
    env["PYTHONPATH"] = str(REPO)
    return env


def first_line(proc: subprocess.Popen[bytes], timeout: float = 15) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    line = b""
    while not line.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} did not start")
        if select.select([proc.stdout], [], [], left)[0]:
            byte = proc.stdout.read(1)
            if not byte:
                raise RuntimeError(f"{proc.args!r} closed its stdout")
            line += byte
    return line.decode().strip()


class Bench:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        self.procs: list[subprocess.Popen[bytes]] = []
        self.events = workdir / "socks-events.jsonl"
        self.socks_port = 0
        self.sink_port = 0
        self.proxychains = shutil.which("proxychains4")

    def start(self) -> None:
        socks = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "libs.socks5",
                "--listen",
                "127.0.0.1:0",
                "--events",
                str(self.events),
            ],
            cwd=REPO,
            env=base_env(),
            stdout=subprocess.PIPE,
            bufsize=0,
        )
        self.procs.append(socks)
        self.socks_port = int(first_line(socks).rpartition(":")[2])
        sink = subprocess.Popen(
            [str(NETBENCH), "sink", PEER, "0"], stdout=subprocess.PIPE, bufsize=0
        )
        self.procs.append(sink)
        self.sink_port = int(json.loads(first_line(sink))["port"])
        conf = self.workdir / "proxychains.conf"
        conf.write_text(
            "strict_chain\nquiet_mode\ntcp_read_time_out 15000\ntcp_connect_time_out 8000\n"
            f"[ProxyList]\nsocks5 127.0.0.1 {self.socks_port}\n"
        )
        self.proxychains_conf = conf

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    def command(self, path: str, args: Sequence[str]) -> tuple[list[str], dict[str, str]]:
        env = base_env()
        program = [str(NETBENCH), *args]
        socks = f"127.0.0.1:{self.socks_port}"
        if path == "shim":
            env = netshim.preload_env(env, peers=[PEER], socks=socks)
        elif path == "shim_bypass":
            env = netshim.preload_env(env, peers=[NOT_A_PEER], socks=socks)
        elif path == "proxychains4":
            assert self.proxychains is not None
            program = [self.proxychains, "-q", "-f", str(self.proxychains_conf), *program]
        return program, env

    def run(self, path: str, args: Sequence[str], timeout: float = 600) -> dict[str, Any]:
        program, env = self.command(path, args)
        done = subprocess.run(program, env=env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{path}: {' '.join(program)} failed: {done.stderr.strip()[-500:]}")
        result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
        return result

    def _count(self) -> int:
        if not self.events.exists():
            return 0
        return sum(
            1
            for line in self.events.read_text().splitlines()
            if '"event":"connected"' in line and '"reply":0' in line
        )

    def carried(self) -> int:
        """Connections the endpoint logged, once its log has caught up (it writes each event
        as the connection is set up, a moment after the client returned)."""
        count, deadline = self._count(), time.monotonic() + 5
        while time.monotonic() < deadline:
            time.sleep(0.05)
            again = self._count()
            if again == count:
                return count
            count = again
        return count

    def paths(self) -> list[str]:
        return [p for p in PATHS if p != "proxychains4" or self.proxychains is not None]

    def connects(self) -> dict[str, Any]:
        per_round = max(1, self.args.connects // self.args.rounds)
        samples: dict[str, list[float]] = {p: [] for p in self.paths()}
        carried: dict[str, int] = dict.fromkeys(samples, 0)
        for path in samples:  # warm up: page cache, the endpoint's first accepts
            self.run(path, ["connect", PEER, str(self.sink_port), "20"])
        order = list(samples)
        for round_no in range(self.args.rounds):
            log(f"connect round {round_no + 1}/{self.args.rounds}")
            # Rotate the order each round: the endpoint's tail latency depends on what ran
            # just before, and every path should take every position equally often.
            shift = round_no % len(order)
            for path in order[shift:] + order[:shift]:
                before = self.carried()
                result = self.run(path, ["connect", PEER, str(self.sink_port), str(per_round)])
                samples[path].extend(result["samples_us"])
                carried[path] += self.carried() - before
        out: dict[str, Any] = {}
        for path, values in samples.items():
            values.sort()
            out[path] = {
                "n": len(values),
                "p50_us": round(percentile(values, 50), 1),
                "p90_us": round(percentile(values, 90), 1),
                "p99_us": round(percentile(values, 99), 1),
                "mean_us": round(statistics.fmean(values), 1),
                "min_us": round(values[0], 1),
                "carried_by_endpoint": carried[path],
            }
        return out

    def streams(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for path in self.paths():
            runs = []
            for repeat in range(self.args.repeats):
                log(f"stream {path} {repeat + 1}/{self.args.repeats}")
                result = self.run(path, ["stream", PEER, str(self.sink_port), str(self.args.bytes)])
                runs.append(result["bytes"] / result["seconds"] / 1e9)
            out[path] = {
                "bytes": self.args.bytes,
                "best_gbytes_s": round(max(runs), 3),
                "median_gbytes_s": round(statistics.median(runs), 3),
                "runs_gbytes_s": [round(r, 3) for r in runs],
            }
        return out


def percentile(sorted_values: list[float], pct: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, max(0, round(pct / 100 * len(sorted_values)) - 1))
    return sorted_values[index]


def ratio(a: float, b: float) -> float | None:
    return round(a / b, 2) if b else None


def ratios(connect: dict[str, Any], stream: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "connect_p50_shim_over_direct": ratio(
            connect["shim"]["p50_us"], connect["direct"]["p50_us"]
        ),
        "connect_p50_bypass_over_direct": ratio(
            connect["shim_bypass"]["p50_us"], connect["direct"]["p50_us"]
        ),
        "stream_bypass_over_direct": ratio(
            stream["shim_bypass"]["best_gbytes_s"], stream["direct"]["best_gbytes_s"]
        ),
        "stream_bypass_over_direct_median": ratio(
            stream["shim_bypass"]["median_gbytes_s"], stream["direct"]["median_gbytes_s"]
        ),
        "stream_shim_over_direct": ratio(
            stream["shim"]["best_gbytes_s"], stream["direct"]["best_gbytes_s"]
        ),
        # The endpoint's splice: how much slower a stream through it is than direct.
        "splice_cost_direct_over_via_endpoint": ratio(
            stream["direct"]["best_gbytes_s"], stream["shim"]["best_gbytes_s"]
        ),
    }
    if "proxychains4" in connect:
        out["connect_p50_shim_over_proxychains4"] = ratio(
            connect["shim"]["p50_us"], connect["proxychains4"]["p50_us"]
        )
        out["connect_p99_shim_over_proxychains4"] = ratio(
            connect["shim"]["p99_us"], connect["proxychains4"]["p99_us"]
        )
        out["stream_shim_over_proxychains4"] = ratio(
            stream["shim"]["best_gbytes_s"], stream["proxychains4"]["best_gbytes_s"]
        )
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    netshim.ensure_built()
    result: dict[str, Any] = {
        "params": {
            "connects_per_path": args.connects,
            "rounds": args.rounds,
            "stream_bytes": args.bytes,
            "stream_repeats": args.repeats,
        },
        "machine": {
            "cpus": os.cpu_count(),
            "kernel": platform.release(),
            "python": platform.python_version(),
            "endpoint": "libs.socks5 (uvloop) on 127.0.0.1",
            "sink": f"netbench sink on {PEER}",
        },
    }
    with tempfile.TemporaryDirectory(prefix="nodus-bench-shim-") as tmp:
        bench = Bench(args, Path(tmp))
        if bench.proxychains is None:
            result["proxychains4"] = "not installed (Debian proxychains4; make system-deps)"
        try:
            bench.start()
            result["connect"] = bench.connects()
            result["stream"] = bench.streams()
        except (RuntimeError, subprocess.TimeoutExpired, OSError) as exc:
            result["error"] = str(exc)
            return result
        finally:
            bench.stop()
    result["ratios"] = ratios(result["connect"], result["stream"])
    return result


def main(argv: Sequence[str] | None = None) -> int:
    result = run(parse_args(argv))
    print(json.dumps(result, indent=2))
    return 1 if "error" in result else 0


if __name__ == "__main__":
    sys.exit(main())

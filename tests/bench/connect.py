"""Connect-latency bench: connect() through the shim on a live Relayed path, and on a dead one.

    .venv/bin/python -m tests.bench.connect            # about 3 minutes (before issue 9)
    .venv/bin/python -m tests.bench.connect --quick    # the same, fewer connects (smoke)

What runs (all real processes, `LocalSystem`, built as tests/bench/relay.py builds its cap-off
system: nats-server, the placer, the runner, two meshed relays, the remediator, one agent per
machine): a 2-machine fleet (container A, VM B, transport Auto -> Relayed) and one job whose
ranks run `sleep`; nothing is measured before the job is Running and both members' tunnels
are up. An echo listener on B's address stands for a rank's server. The clients are C
programs from netshim/tests (so the figures are the path's, not an interpreter's), run with
rank 0's environment exactly as `nodus env` renders it (LD_PRELOAD the shim,
NODUS_NETSHIM_PEERS, NODUS_NETSHIM_SOCKS: what the placer hands the rank):

  live     N blocking connect() calls per path, each closed at once (`netbench connect`), in
           interleaved rounds whose order alternates: `direct` (no preload: the baseline, the
           same listener) and `shim` (through A's agent, the relays, B's agent); p50, p90, p99
           in microseconds, and the connects that failed. Then one connect that carries an
           echo both ways (`nbconnect blocking`), to prove the path carries bytes.
  dead     B's agent is stopped, then at once (in parallel, from the same instant) K blocking
           connects (`nbconnect blocking`) and one Python connect with the caller's own
           timeout (`socket.settimeout(CALLER_TIMEOUT)`): how long each took to return and
           with which errno (each capped at CAP seconds, then killed: `returned: false`);
           `at_once`. The same again LATER (5) seconds after the stop, while the first wave
           may still wait (`after_5s`): by then the agent may have learned the peer is gone.
           Each mode on a fresh system:
             stop        SIGSTOP (a hung agent: its sockets stay open); afterwards SIGCONT,
                         and the time until a connect with an echo works again
                         (`recovered_after_cont_s`)
             term        SIGTERM (a clean shutdown), timed from the agent's exit
             kill        SIGKILL, timed from the agent's exit
             stop-stock  SIGSTOP with the placer as configured by default
           In stop, term and kill the placer's heartbeat timeout is raised (--placer-timeout),
           so the epoch outlives the measurement and what the connect gets is the dataplane's
           own answer; in stop-stock the placer ends the epoch once the agent has been silent
           for its stock heartbeatTimeoutSeconds (15 s), and the connect gets whatever the end
           of the epoch gives it first. With each, the job's phase after, and the error lines
           in the daemons' logs.

Why its own file and not tests/bench/shim.py: that bench measures the shim's own cost against
one in-process SOCKS endpoint and runs in seconds with no system; this one needs the whole
Relayed system (agents, relays, a job) and stops agents, so its run time (30-s dials before
issue 9) and its failure modes are those of the dataplane, not of the shim.

Speed is reported, never asserted; stdout carries one JSON object, progress goes to stderr.
Exit status 1 means the run did not complete (a system did not come up, a live connect with
an echo failed before any agent was stopped, the budget ran out), not that it was slow; a
mode whose system failed is reported as such (`modes.MODE.error`) and the others still run.
Every process the bench starts is stopped when it ends, however it ends (the daemons' ranks
too, a killed agent's included); `--keep-state` (or an error) keeps the state dir and logs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import resource
import signal
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from app.local import LocalSystem
from libs import netshim
from services.placer.config import DEFAULT_CONFIG, load_config
from tests.bench.relay_streams import ratio
from tests.bench.relay_system import ORG, Bench, cleanup
from tests.bench.running import (
    add_run_flags,
    bench_main,
    bench_parser,
    machine_facts,
    progress,
    run_bench,
)
from tests.bench.sampling import cpu_seconds, kill_left_behind, machine_busy, spawned_below

# How B's agent is stopped, and whether the placer's heartbeat timeout is raised out of the
# way (so the epoch outlives the measurement and the figure is the dataplane's own) or stock
# (the placer ends the epoch when the agent has been silent for its 15 s).
MODES: dict[str, tuple[signal.Signals, bool]] = {
    "stop": (signal.SIGSTOP, True),
    "term": (signal.SIGTERM, True),
    "kill": (signal.SIGKILL, True),
    "stop-stock": (signal.SIGSTOP, False),
}
NETBENCH = netshim.TEST_PROGRAMS / "netbench"
NBCONNECT = netshim.TEST_PROGRAMS / "nbconnect"
CALLER_TIMEOUT = 2.0  # seconds: the Python client's own socket.settimeout
RECOVERY_WAIT = 30.0  # seconds after SIGCONT to wait for a working path
# The second wave of dead connects starts this long after the stop (the first at once): has
# the agent learned by then that the peer is gone (past the relays' 3-s silence rule)?
LATER = 5.0
# A Python client with its own connect timeout, as a rank would write one; one JSON line.
PY_CONNECT = """
import errno, json, socket, sys, time
sock = socket.socket()
sock.settimeout(float(sys.argv[3]))
start = time.monotonic()
try:
    sock.connect((sys.argv[1], int(sys.argv[2])))
    result, name = "ok", "0"
except TimeoutError:
    result, name = "error", "timeout"
except OSError as error:
    result, name = "error", errno.errorcode.get(error.errno or 0, str(error.errno))
print(json.dumps({"result": result, "errno": name, "ms": (time.monotonic() - start) * 1e3}))
"""
ERROR_LINE = re.compile(r'"level": ?"error"|Unhandled exception|Traceback')
ADDRESS = re.compile(r"0x[0-9a-f]+")  # object addresses: lines that differ only there are one


log = progress("connect")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = bench_parser("connect", __doc__)
    parser.add_argument("--connects", type=int, default=1000, help="live connects per path")
    parser.add_argument("--rounds", type=int, default=10, help="interleaved rounds of them")
    parser.add_argument("--dead", type=int, default=5, help="blocking connects per dead mode")
    parser.add_argument("--cap", type=float, default=35.0, help="seconds a dead connect may take")
    parser.add_argument(
        "--modes", default=",".join(MODES), help=f"comma-separated dead modes: {','.join(MODES)}"
    )
    parser.add_argument(
        "--placer-timeout",
        type=float,
        default=300.0,
        help="the placer's heartbeat timeout in the modes that raise it, seconds",
    )
    add_run_flags(parser, 900.0, "200 connects, 2 dead ones (smoke)")
    args = parser.parse_args(argv)
    if args.quick:
        args.connects, args.rounds, args.dead = 200, 4, 2
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or set(args.modes) - MODES.keys():
        parser.error(f"--modes: pick from {','.join(MODES)}")
    return args


def base_env() -> dict[str, str]:
    """This process's environment without proxies or a shim of its own."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.lower().endswith("_proxy") and not k.startswith(("NODUS_NETSHIM", "LD_PRELOAD"))
    }


def percentile(sorted_values: list[float], pct: float) -> float | None:
    if not sorted_values:
        return None
    index = min(len(sorted_values) - 1, max(0, round(pct / 100 * len(sorted_values)) - 1))
    return sorted_values[index]


async def run_json(
    program: list[str], env: dict[str, str], cap: float
) -> tuple[dict[str, Any] | None, float, bool]:
    """Run a client; (its last JSON line, wall seconds, returned within `cap`)."""
    start = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *program,
        env=env,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        stdout, _ = await asyncio.wait_for(proc.communicate(), cap)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        return None, time.monotonic() - start, False
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    wall = time.monotonic() - start
    lines = stdout.decode(errors="replace").strip().splitlines()
    try:
        return (json.loads(lines[-1]) if lines else None), wall, True
    except json.JSONDecodeError:
        return None, wall, True


class Echo:
    """The rank's server on B's address: echoes what it reads until EOF."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.port = 0
        self.accepted = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, self.host, 0, backlog=1024)
        self.port = self.server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()


def ours() -> float:
    """CPU seconds of this process and everything below it (the system's daemons, live or
    reaped, and the clients): what the machine spent on this bench."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    live = cpu_seconds({"tree": [os.getpid()]}, tree=True)["tree"]
    return live + children.ru_utime + children.ru_stime


class Load:
    """How busy the machine was over a stretch, and how much of that was other programs."""

    def __init__(self) -> None:
        self.t0, self.busy0, self.ours0 = time.monotonic(), machine_busy(), ours()

    def figures(self) -> dict[str, float]:
        window = time.monotonic() - self.t0
        busy, mine = machine_busy() - self.busy0, ours() - self.ours0
        return {
            "machine_busy_cores": round(busy / window, 2),
            "others_busy_cores": round((busy - mine) / window, 2),
        }


def log_errors(system: LocalSystem) -> dict[str, Any]:
    """Lines that are errors in each daemon's log (`"level": "error"`, an unhandled
    exception, a traceback): per daemon, how many, and each distinct one once, shortened to
    its logger, the first line of its message and the last line of its traceback."""
    out: dict[str, Any] = {}
    logs = system.state_dir / "logs"
    for path in sorted(logs.glob("*.log")) if logs.exists() else []:
        distinct: dict[str, int] = {}
        for line in path.read_text(errors="replace").splitlines():
            if ERROR_LINE.search(line):
                key = _short(line)
                distinct[key] = distinct.get(key, 0) + 1
        if distinct:
            out[path.stem] = {"lines": sum(distinct.values()), "distinct": distinct}
    return out


def _short(line: str) -> str:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return line[:300]
    if not isinstance(record, dict):
        return line[:300]
    message = ADDRESS.sub("0x...", (str(record.get("msg", "")).splitlines() or [""])[0])
    text = f"{record.get('logger', '?')}: {message[:200]}"
    exc = str(record.get("exc", "")).strip().splitlines()
    return f"{text} | {exc[-1][:200]}" if exc else text


class ConnectBench:
    def __init__(self, args: argparse.Namespace, state: Path) -> None:
        self.args = args
        self.state = state
        self.bench = Bench(args, state)
        self.env: dict[str, str] = {}
        self.peer = ""

    async def mode(self, mode: str) -> dict[str, Any]:
        bench = self.bench
        sig, raised = MODES[mode]
        placer: Path | None = None
        timeout = self.args.placer_timeout if raised else None
        if timeout is not None:
            settings = yaml.safe_load(DEFAULT_CONFIG.read_text())
            settings["heartbeatTimeoutSeconds"] = timeout
            placer = self.state / f"placer-{mode}.yaml"
            placer.write_text(yaml.safe_dump(settings))
        [gang] = await bench.up(f"connect-{mode}", 1, [], placer_config=placer)
        system, client = bench.system, bench.client
        assert system is not None and client is not None and gang.sinks is not None
        for sink in gang.sinks:
            await sink.stop()  # the relay bench's stream sinks: not used here
        rank_env = await client.rank_env(gang.name, 0, ORG)
        peers = rank_env.get(netshim.ENV_PEERS, "").split(",")
        if len(peers) != 1 or peers[0] not in gang.hosts:
            raise RuntimeError(f"rank 0's {netshim.ENV_PEERS} is {peers}, not one of {gang.hosts}")
        self.peer = peers[0]
        peer_node = gang.nodes[gang.hosts.index(self.peer)]
        self.env = base_env() | rank_env
        echo = Echo(self.peer)
        await echo.start()
        out: dict[str, Any] = {
            "signal": sig.name,
            "placer_heartbeat_timeout_s": timeout or load_config().heartbeat_timeout_seconds,
            "homes": gang.homes,
            "gang": gang.lifecycle,
            "rank0_env": {
                k: rank_env.get(k) for k in ("LD_PRELOAD", netshim.ENV_PEERS, netshim.ENV_SOCKS)
            },
            "peer": {"node": peer_node, "address": self.peer},
        }
        try:
            out["live"] = await self.live(echo.port)
            sanity = await self.echo_once(echo.port, cap=15.0)
            out["live"]["echo_through_shim"] = sanity
            if sanity.get("result") != "ok":
                raise RuntimeError(f"a live connect with an echo failed: {sanity}")
            out["dead"] = await self.dead(sig, system, peer_node, echo.port)
            job = await client.get_job(gang.name)
            out["dead"]["job_phase_after"] = job.status.phase.value
            out["log_errors"] = log_errors(system)
        finally:
            await echo.stop()
            await bench.down()
        return out

    async def live(self, port: int) -> dict[str, Any]:
        per_round = max(1, self.args.connects // self.args.rounds)
        samples: dict[str, list[float]] = {"direct": [], "shim": []}
        failures = dict.fromkeys(samples, 0)
        stuck = dict.fromkeys(samples, 0)
        envs = {"direct": base_env(), "shim": self.env}
        for env in envs.values():  # warm up: page cache, the endpoints' first accepts
            await run_json([str(NETBENCH), "connect", self.peer, str(port), "10"], env, 60)
        load = Load()
        for round_no in range(self.args.rounds):
            order = list(samples) if round_no % 2 == 0 else list(reversed(samples))
            for path in order:
                program = [str(NETBENCH), "connect", self.peer, str(port), str(per_round)]
                result, _, returned = await run_json(program, envs[path], 120)
                if not returned or result is None:
                    stuck[path] += 1
                    continue
                samples[path].extend(result["samples_us"])
                failures[path] += int(result["failures"])
        out: dict[str, Any] = load.figures()
        for path, values in samples.items():
            values.sort()
            figures: dict[str, Any] = {"n": len(values), "failures": failures[path]}
            for pct in (50, 90, 99):
                value = percentile(values, pct)
                figures[f"p{pct}_us"] = round(value, 1) if value is not None else None
            figures["mean_us"] = round(statistics.fmean(values), 1) if values else None
            figures["max_us"] = round(values[-1], 1) if values else None
            if stuck[path]:
                figures["rounds_killed_after_120s"] = stuck[path]
            out[path] = figures
        out["p50_shim_over_direct"] = ratio(out["shim"]["p50_us"], out["direct"]["p50_us"])
        out["p99_shim_over_direct"] = ratio(out["shim"]["p99_us"], out["direct"]["p99_us"])
        log(
            f"live: direct p50 {out['direct']['p50_us']} us, shim p50 {out['shim']['p50_us']} "
            f"p99 {out['shim']['p99_us']} us ({out['shim']['failures']} failed)"
        )
        return out

    async def echo_once(self, port: int, cap: float) -> dict[str, Any]:
        program = [str(NBCONNECT), "blocking", self.peer, str(port), "hello"]
        result, wall, returned = await run_json(program, self.env, cap)
        return {**(result or {}), "wall_s": round(wall, 3), "returned": returned}

    async def dead(
        self, sig: signal.Signals, system: LocalSystem, node: str, port: int
    ) -> dict[str, Any]:
        child = next(c for c in system.children if c.name == f"agent-{node}")
        pid = child.process.pid
        # What the agent started (its ranks): killed by pid at the end if it left them behind.
        spawned = spawned_below([pid])
        out: dict[str, Any] = {"agent": child.name}
        stopping = sig is signal.SIGSTOP
        stopped = time.monotonic()
        os.kill(pid, sig)
        try:
            if not stopping:
                await asyncio.to_thread(child.process.wait, 30)
                out["agent_exit_s"] = round(time.monotonic() - stopped, 3)
                out["agent_exit_code"] = child.process.returncode
            log(f"dead ({sig.name}): {self.args.dead} blocking connects and a Python one at once")
            waves = await asyncio.gather(self.dead_wave(port), self.dead_wave(port, LATER))
            out["cap_s"] = self.args.cap
            out["at_once"], out[f"after_{LATER:g}s"] = waves
            if stopping:
                os.kill(pid, signal.SIGCONT)
                out["recovered_after_cont_s"] = await self.recovery(port)
        finally:
            if stopping:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            else:
                kill_left_behind(spawned)
        return out

    async def dead_wave(self, port: int, delay: float = 0.0) -> dict[str, Any]:
        """K blocking connects and a Python one, all at once, `delay` s after the stop."""
        await asyncio.sleep(delay)
        cap = self.args.cap
        blocking = [str(NBCONNECT), "blocking", self.peer, str(port), "hello"]
        python = [sys.executable, "-c", PY_CONNECT, self.peer, str(port), str(CALLER_TIMEOUT)]
        load = Load()
        runs = await asyncio.gather(
            *(run_json(blocking, self.env, cap) for _ in range(self.args.dead)),
            run_json(python, self.env, cap),
        )
        busy = load.figures()

        def sample(run: tuple[dict[str, Any] | None, float, bool]) -> dict[str, Any]:
            result, wall, returned = run
            return {
                "returned": returned,
                "seconds": round(wall, 3),
                "result": (result or {}).get("result"),
                "errno": (result or {}).get("errno"),
                "connect_ms": (result or {}).get("ms"),
            }

        samples = [sample(r) for r in runs[:-1]]
        seconds = sorted(s["seconds"] for s in samples)
        caller = sample(runs[-1])
        caller["timeout_s"] = CALLER_TIMEOUT
        caller["overshoot_s"] = round(caller["seconds"] - CALLER_TIMEOUT, 3)
        errnos: dict[str, int] = {}
        for s in samples:
            key = str(s["errno"]) if s["returned"] else f"none: killed after {cap:g} s"
            errnos[key] = errnos.get(key, 0) + 1
        log(f"dead, {delay:g} s after: blocking connects returned after {seconds} s with {errnos}")
        return {
            "started_after_stop_s": delay,
            "blocking": {
                "n": len(samples),
                "returned": sum(s["returned"] for s in samples),
                "seconds_p50": percentile(seconds, 50),
                "seconds_max": seconds[-1] if seconds else None,
                "errnos": errnos,
                "samples": samples,
            },
            "python_settimeout": caller,
            **busy,
        }

    async def recovery(self, port: int) -> float | None:
        """Seconds after SIGCONT until a connect with an echo works again (None: not within
        RECOVERY_WAIT)."""
        start = time.monotonic()
        while time.monotonic() - start < RECOVERY_WAIT:
            left = RECOVERY_WAIT - (time.monotonic() - start)
            result = await self.echo_once(port, cap=max(1.0, min(left, 10.0)))
            if result.get("result") == "ok":
                return round(time.monotonic() - start, 3)
            await asyncio.sleep(0.2)
        return None


async def run_async(args: argparse.Namespace, state: Path) -> dict[str, Any]:
    result: dict[str, Any] = {
        "params": {
            "live_connects_per_path": args.connects,
            "live_rounds": args.rounds,
            "dead_blocking_connects": args.dead,
            "dead_cap_s": args.cap,
            "caller_timeout_s": CALLER_TIMEOUT,
            "modes": args.modes,
            "placer_heartbeat_timeout_raised_s": args.placer_timeout,
        },
        "machine": machine_facts(),
        "modes": {},
    }
    bench = ConnectBench(args, state)
    try:
        for mode in args.modes:
            try:
                result["modes"][mode] = await bench.mode(mode)
            except Exception as error:  # this mode's system failed: the others still run
                log(f"{mode}: {type(error).__name__}: {error}")
                result["modes"][mode] = {"error": f"{type(error).__name__}: {error}"}
                await bench.bench.down()
    finally:
        await bench.bench.down()
        result["machine"]["loadavg_at_end"] = os.getloadavg()
    result["summary"] = summary({m: v for m, v in result["modes"].items() if "error" not in v})
    failed = [m for m, v in result["modes"].items() if "error" in v]
    if failed:
        result["error"] = f"modes that did not complete: {', '.join(failed)} (see modes)"
    return result


def summary(modes: dict[str, Any]) -> dict[str, Any]:
    """The headline figures: live p50/p99 per system, and per dead mode how long a blocking
    connect took to return, with which errno, and whether the caller's timeout held."""
    out: dict[str, Any] = {"live": {}, "dead": {}}
    for mode, m in modes.items():
        live = m["live"]
        out["live"][mode] = {
            "direct_p50_us": live["direct"]["p50_us"],
            "direct_p99_us": live["direct"]["p99_us"],
            "shim_p50_us": live["shim"]["p50_us"],
            "shim_p99_us": live["shim"]["p99_us"],
            "shim_failures": live["shim"]["failures"],
            "others_busy_cores": live["others_busy_cores"],
        }
        dead = m["dead"]
        out["dead"][mode] = {"placer_heartbeat_timeout_s": m["placer_heartbeat_timeout_s"]}
        for wave in ("at_once", f"after_{LATER:g}s"):
            figures = dead[wave]
            out["dead"][mode][wave] = {
                "blocking_seconds_p50": figures["blocking"]["seconds_p50"],
                "blocking_seconds_max": figures["blocking"]["seconds_max"],
                "blocking_errnos": figures["blocking"]["errnos"],
                "python_settimeout_seconds": figures["python_settimeout"]["seconds"],
                "python_settimeout_errno": figures["python_settimeout"]["errno"],
            }
        out["dead"][mode] |= {
            "recovered_after_cont_s": dead.get("recovered_after_cont_s"),
            "job_phase_after": dead.get("job_phase_after"),
        }
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    netshim.ensure_built()
    return run_bench("nodus-bench-connect-", lambda state: run_async(args, state), args, cleanup)


def main(argv: Sequence[str] | None = None) -> int:
    return bench_main(run, parse_args(argv), cleanup)


if __name__ == "__main__":
    sys.exit(main())

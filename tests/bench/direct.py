"""Direct-path benchmark (issue 11): `nodus0` (wireguard-go) between lab VMs, ICE, and the
fallback to the relays, with real processes in network namespaces (app/netlab; root).

    .venv/bin/python -m tests.bench.direct            # about 2 minutes
    .venv/bin/python -m tests.bench.direct --quick    # about 1 minute (smoke)

  goodput    two VMs of different providers (a LAN each, routed through the lab's
             "internet"), Direct members as the agent runs them (tests/integration/direct_lab.py).
             iperf3 B -> A over `nodus0` (the mesh addresses) against plain TCP between the same
             namespaces' eth0 addresses (the ceiling), in interleaved rounds; CPU seconds per
             Gbit of both wireguard-go processes over the nodus0 runs, and of both agents (the
             agents are not on the data path: near 0). And wireguard-go set up by hand with
             `wg` between two bare namespaces on one veth: the implementation's own figure on
             this machine, to read nodus0's by.
  ice        for 2, 4 and 8 members (half of them behind their providers' NATs): seconds from
             the members' start until every pair's first round of checks ended, and how many
             pairs went direct.
  fallback   a TCP stream over nodus0 (a 1 KiB message every 5 ms, each stamped); UDP is cut
             in A's namespace, then restored: seconds until both members say `derp:` and
             `direct` again, and the longest interval with no message delivered around the cut
             and around the restore, against the longest before the cut (the baseline).

Speed is reported, never asserted; stdout carries one JSON object, progress goes to stderr.
Exit status 1 means the run did not complete, not that it was slow.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from app.demo import lab_unavailable
from app.netlab import NetLab
from tests.bench.running import add_run_flags, bench_main, bench_parser, machine_facts, progress
from tests.bench.sampling import process_cpu
from tests.integration.direct_lab import Members, direct_members
from tests.integration.lab_programs import lab_fleet, running_lab

say = progress("direct")

CUT = """table inet nodus_bench_cut {
  chain out { type filter hook output priority filter; oifname "eth0" meta l4proto udp drop; }
  chain in { type filter hook input priority filter; iifname "eth0" meta l4proto udp drop; }
}
"""

RECEIVE = """
import socket, sys, time, json
s = socket.create_server(("{address}", 7100))
print("ready", flush=True)
conn, _ = s.accept()
arrivals, buffer = [], b""
while chunk := conn.recv(65536):
    buffer += chunk
    while len(buffer) >= 1024:
        buffer = buffer[1024:]
        arrivals.append(time.monotonic())
print(json.dumps(arrivals))
"""

SEND = """
import socket, time, sys
end = time.monotonic() + {seconds}
with socket.create_connection(("{address}", 7100), timeout=30) as s:
    while time.monotonic() < end:
        s.sendall(b"x" * 1024)
        time.sleep(0.005)
"""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = bench_parser("direct", __doc__)
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each iperf3 run")
    parser.add_argument("--rounds", type=int, default=2, help="goodput rounds of each path")
    parser.add_argument(
        "--members", type=int, nargs="+", default=[2, 4, 8], help="gang sizes for ICE"
    )
    add_run_flags(parser, 600.0, "2 s runs, 1 round, ICE for 2 and 4 members")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.rounds, args.members = 2.0, 1, [2, 4]
    return args


def _machines(count: int) -> list[tuple[str, str, bool, str, str]]:
    """(name, provider, behind NAT, address, mesh address): one provider LAN each, every
    other one behind its NAT."""
    found = []
    for i in range(count):
        nat = i % 2 == 1
        address = f"198.19.{10 + i}.1" if nat else f"198.18.{10 + i}.1"
        found.append((f"vm{i}", f"p{i}", nat, address, f"100.64.20.{i + 1}"))
    return found


def _lab(machines: list[tuple[str, str, bool, str, str]], state: Path) -> Any:
    fleet = lab_fleet(
        *((name, provider, address, nat) for name, provider, nat, address, _ in machines)
    )
    return running_lab(fleet, state, reach_from_host=True)


def _wireguard_pids(lab: NetLab, machine: str) -> list[int]:
    namespace = lab.topology.machines[machine]
    listed = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
    pids = []
    for pid in listed.stdout.split():
        try:
            comm = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if comm == "wireguard-go":
            pids.append(int(pid))
    return pids


def _cpu(pids: list[int]) -> float:
    return sum(process_cpu(pid) or 0.0 for pid in pids)


def _iperf3(lab: NetLab, client: str, server: str, target: str, seconds: float) -> float:
    """Gbit/s received, `client` -> `target` (an address of `server`)."""
    listening = subprocess.Popen(
        lab.machine_argv(server, ["iperf3", "-s", "-1", "-B", target]), stdout=subprocess.DEVNULL
    )
    try:
        time.sleep(0.4)
        done = subprocess.run(
            lab.machine_argv(client, ["iperf3", "-c", target, "-t", str(seconds), "--json"]),
            capture_output=True,
            text=True,
            timeout=seconds + 30,
        )
        if done.returncode != 0:
            raise RuntimeError(f"iperf3 {client} -> {target}: {done.stdout[-500:]}")
        report = json.loads(done.stdout)
        return float(report["end"]["sum_received"]["bits_per_second"]) / 1e9
    finally:
        listening.kill()
        listening.wait()


def goodput(args: argparse.Namespace, lab: NetLab, members: Members) -> dict[str, Any]:
    (a, _, _, a_address, a_mesh), (b, *_) = _machines(2)
    wireguard = _wireguard_pids(lab, a) + _wireguard_pids(lab, b)
    agents = [members.processes[a].pid, members.processes[b].pid]
    runs: dict[str, list[float]] = {"eth0": [], "nodus0": []}
    cpu = {"wireguard_go": 0.0, "agents": 0.0}
    gbit = 0.0
    for round_ in range(args.rounds):
        for path in ("eth0", "nodus0") if round_ % 2 == 0 else ("nodus0", "eth0"):
            target = a_address if path == "eth0" else a_mesh
            before = (_cpu(wireguard), _cpu(agents))
            rate = _iperf3(lab, b, a, target, args.seconds)
            if path == "nodus0":
                cpu["wireguard_go"] += _cpu(wireguard) - before[0]
                cpu["agents"] += _cpu(agents) - before[1]
                gbit += rate * args.seconds
            runs[path].append(round(rate, 3))
            say(f"goodput {path}: {rate:.2f} Gbit/s")
    best = {path: max(rates) for path, rates in runs.items()}
    return {
        "gbit_s": runs,
        "best_gbit_s": best,
        "nodus0_over_eth0": round(best["nodus0"] / best["eth0"], 3) if best["eth0"] else None,
        "cpu_s_per_gbit": {k: round(v / gbit, 3) if gbit else None for k, v in cpu.items()},
        "wireguard_processes": len(wireguard),
    }


def bare_wireguard_go(seconds: float, state: Path) -> dict[str, Any]:
    """wireguard-go configured by hand (`wg`), between two namespaces on one veth and nothing
    else: what the implementation itself does on this machine, to read nodus0's figure by."""
    prefix = f"nbw{os.getpid() % 10000}"
    a, b = f"{prefix}-a", f"{prefix}-b"
    keys = {}
    for side in ("a", "b"):
        private = subprocess.run(["wg", "genkey"], capture_output=True, text=True, check=True)
        public = subprocess.run(
            ["wg", "pubkey"], input=private.stdout, capture_output=True, text=True, check=True
        )
        (state / f"bare-{side}.key").write_text(private.stdout)
        keys[side] = public.stdout.strip()
    steps = [
        ["ip", "netns", "add", a],
        ["ip", "netns", "add", b],
        ["ip", "link", "add", f"{prefix}a", "type", "veth", "peer", "name", f"{prefix}b"],
        ["ip", "link", "set", f"{prefix}a", "netns", a],
        ["ip", "link", "set", f"{prefix}b", "netns", b],
    ]
    devices = {"a": f"{prefix}wa", "b": f"{prefix}wb"}
    for side, namespace, underlay in (("a", a, "198.18.250.1"), ("b", b, "198.18.250.2")):
        steps += [
            ["ip", "-n", namespace, "addr", "add", f"{underlay}/24", "dev", f"{prefix}{side}"],
            ["ip", "-n", namespace, "link", "set", f"{prefix}{side}", "up"],
            ["ip", "-n", namespace, "link", "set", "lo", "up"],
        ]
    try:
        for step in steps:
            subprocess.run(step, check=True)
        for side, namespace in (("a", a), ("b", b)):
            subprocess.run(
                ["ip", "netns", "exec", namespace, "wireguard-go", devices[side]],
                env={**os.environ, "WG_I_PREFER_BUGGY_USERSPACE_TO_POLISHED_KMOD": "1"},
                check=True,
                capture_output=True,
            )
        for side, namespace, peer, peer_underlay, mesh, peer_mesh in (
            ("a", a, "b", "198.18.250.2", "100.64.250.1", "100.64.250.2"),
            ("b", b, "a", "198.18.250.1", "100.64.250.2", "100.64.250.1"),
        ):
            device = devices[side]
            exec_ = ["ip", "netns", "exec", namespace]
            subprocess.run(
                [
                    *exec_,
                    "wg",
                    "set",
                    device,
                    "private-key",
                    str(state / f"bare-{side}.key"),
                    "listen-port",
                    "51820",
                    "peer",
                    keys[peer],
                    "allowed-ips",
                    f"{peer_mesh}/32",
                    "endpoint",
                    f"{peer_underlay}:51820",
                ],
                check=True,
            )
            subprocess.run(
                ["ip", "-n", namespace, "addr", "add", f"{mesh}/24", "dev", device], check=True
            )
            subprocess.run(
                ["ip", "-n", namespace, "link", "set", device, "mtu", "1420", "up"], check=True
            )
        server = subprocess.Popen(
            ["ip", "netns", "exec", b, "iperf3", "-s", "-1", "-B", "100.64.250.2"],
            stdout=subprocess.DEVNULL,
        )
        try:
            time.sleep(0.4)
            done = subprocess.run(
                [
                    "ip",
                    "netns",
                    "exec",
                    a,
                    "iperf3",
                    "-c",
                    "100.64.250.2",
                    "-t",
                    str(seconds),
                    "--json",
                ],
                capture_output=True,
                text=True,
                timeout=seconds + 30,
            )
        finally:
            server.kill()
            server.wait()
        rate = float(json.loads(done.stdout)["end"]["sum_received"]["bits_per_second"]) / 1e9
        say(f"bare wireguard-go on one veth: {rate:.2f} Gbit/s")
        return {"gbit_s": round(rate, 3)}
    finally:
        for namespace in (a, b):  # wireguard-go and its device go with the namespace's end
            pids = subprocess.run(
                ["ip", "netns", "pids", namespace], capture_output=True, text=True
            )
            for pid in pids.stdout.split():
                subprocess.run(["kill", "-9", pid], check=False)
            subprocess.run(["ip", "netns", "del", namespace], check=False)
        for device in devices.values():
            Path(f"/var/run/wireguard/{device}.sock").unlink(missing_ok=True)


def _paths(members: Members, names: list[str]) -> list[str]:
    return [path for name in names for path in members.paths(name).values()]


def _until(members: Members, names: list[str], prefix: str, limit: float) -> float | None:
    began = time.monotonic()
    while time.monotonic() - began < limit:
        if all(p.startswith(prefix) for p in _paths(members, names)):
            return round(time.monotonic() - began, 2)
        time.sleep(0.1)
    return None


def _longest_gap(arrivals: list[float], start: float, end: float) -> float:
    inside = [t for t in arrivals if start <= t <= end]
    if len(inside) < 2:
        return end - start
    return max(b - a for a, b in itertools.pairwise(inside))


def fallback(lab: NetLab, members: Members) -> dict[str, Any]:
    (a, *_), (b, _, _, _, b_mesh) = _machines(2)
    names = [a, b]
    receiver = subprocess.Popen(
        lab.machine_argv(b, [sys.executable, "-c", RECEIVE.format(address=b_mesh)]),
        stdout=subprocess.PIPE,
        text=True,
    )
    assert receiver.stdout is not None and receiver.stdout.readline().strip() == "ready"
    seconds = 30.0
    sender = subprocess.Popen(
        lab.machine_argv(a, [sys.executable, "-c", SEND.format(address=b_mesh, seconds=seconds)])
    )
    try:
        began = time.monotonic()
        time.sleep(3.0)
        cut = time.monotonic()
        subprocess.run(lab.machine_argv(a, ["nft", "-f", "-"]), input=CUT, text=True, check=True)
        to_relays = _until(members, names, "derp:", 15.0)
        time.sleep(max(0.0, cut + 8.0 - time.monotonic()))
        restore = time.monotonic()
        subprocess.run(
            lab.machine_argv(a, ["nft", "delete", "table", "inet", "nodus_bench_cut"]), check=True
        )
        to_direct = _until(members, names, "direct", 30.0)
        settled = time.monotonic()
        sender.wait(timeout=seconds + 30)
        out, _ = receiver.communicate(timeout=30)
    finally:
        for process in (sender, receiver):
            if process.poll() is None:
                process.kill()
                process.wait()
    arrivals = json.loads(out)
    # The clocks are one machine's monotonic clock, in every namespace.
    return {
        "seconds_to_relays": to_relays,
        "seconds_to_direct_again": to_direct,
        "longest_gap_ms": {
            "before_cut": round(1000 * _longest_gap(arrivals, began + 0.5, cut), 1),
            "around_cut": round(1000 * _longest_gap(arrivals, cut, restore), 1),
            "around_restore": round(1000 * _longest_gap(arrivals, restore, settled + 2.0), 1),
        },
        "messages": len(arrivals),
    }


def ice(count: int, state: Path) -> dict[str, Any]:
    machines = _machines(count)
    with _lab(machines, state / f"lab-{count}.json") as lab:
        spec = [(name, address, mesh) for name, _, _, address, mesh in machines]
        (state / f"ice-{count}").mkdir()
        with direct_members(lab, state / f"ice-{count}", spec) as members:
            seconds = members.joined_seconds
            direct = sum(len(r["paths"]) for r in members.reports.values()) // 2
            failed = {n: r["failures"] for n, r in members.reports.items() if r["failures"]}
    say(f"ice {count} members: {seconds:.1f} s, {direct} of {count * (count - 1) // 2} direct")
    return {
        "seconds_to_every_pair": round(seconds, 2),
        "pairs": count * (count - 1) // 2,
        "direct_pairs": direct,
        "failures": failed,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    reason = lab_unavailable()
    if reason is not None:
        return {"error": f"the lab cannot run here: {reason}"}
    state = Path(tempfile.mkdtemp(prefix="nodus-bench-direct-"))
    result: dict[str, Any] = {
        "params": {"seconds": args.seconds, "rounds": args.rounds, "members": args.members},
        "machine": machine_facts(),
    }
    started = time.monotonic()
    try:
        machines = _machines(2)
        with _lab(machines, state / "lab.json") as lab:
            spec = [(name, address, mesh) for name, _, _, address, mesh in machines]
            (state / "pair").mkdir()
            with direct_members(lab, state / "pair", spec) as members:
                result["goodput"] = goodput(args, lab, members)
                result["fallback"] = fallback(lab, members)
                say(f"fallback: {result['fallback']}")
        result["goodput"]["bare_wireguard_go"] = bare_wireguard_go(args.seconds, state)
        result["ice"] = {str(n): ice(n, state) for n in args.members}
    except Exception as error:
        result["error"] = f"{type(error).__name__}: {error}"
        result["state_dir"] = str(state)
    result["elapsed_s"] = round(time.monotonic() - started, 1)
    if time.monotonic() - started > args.budget:
        result.setdefault("error", f"over the budget of {args.budget:g} s")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    return bench_main(run, parse_args(argv), lambda: None)


if __name__ == "__main__":
    sys.exit(main())

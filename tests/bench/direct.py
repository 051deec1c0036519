"""Direct-path benchmark (issue 11): `nodus0` (wireguard-go) between lab VMs, ICE, and the
fallback to the relays, with real processes in network namespaces (app/netlab; root).

    .venv/bin/python -m tests.bench.direct            # about 2 minutes
    .venv/bin/python -m tests.bench.direct --quick    # about 1 minute (smoke)

  wireguard  which WireGuard the members ran (as the agent chooses it: kernel or wireguard-go,
             its version, offloads) and the wireguard-go the bare runs used. `--wireguard-go
             PATH` runs another build (e.g. bookworm's 0.0.20220316, from `apt-get download
             wireguard-go=0.0.20220316-1+b4` and `dpkg-deb -x`) in both.
  goodput    two VMs of different providers (a LAN each, routed through the lab's
             "internet", one behind its provider's NAT), Direct members as the agent runs them
             (tests/integration/direct_lab.py). iperf3 B -> A over `nodus0` (the mesh
             addresses), against plain TCP between the same namespaces' eth0 addresses (the
             ceiling) and the same wireguard-go binary set up by hand with `wg`: `bare_veth`
             between two bare namespaces on one veth (the implementation's own figure on this
             machine) and `bare_lab` between the same two VMs, through the lab's routers and
             NAT (the lab's hops without the agent). All four run in interleaved rounds, each
             path in each position; the machine is shared, so `nodus0_over_*` is the median of
             the rounds' own ratios. CPU seconds per Gbit of the wireguard-go processes of each
             WireGuard path, and of both agents (not on the data path: near 0).
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
import asyncio
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from app.demo import lab_unavailable
from app.netlab import NetLab
from services.agent.direct import wireguard
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
    parser.add_argument(
        "--wireguard-go",
        metavar="PATH",
        help="the wireguard-go nodus0 and the bare runs use (default: the agent's choice, "
        "the one on PATH); e.g. bookworm's old build extracted from its .deb",
    )
    add_run_flags(parser, 600.0, "2 s runs, 2 rounds, ICE for 2 and 4 members")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds, args.rounds, args.members = 2.0, 2, [2, 4]
    return args


def wireguard_ran(args: argparse.Namespace) -> dict[str, Any]:
    """Which WireGuard the members run (as the agent chooses it, with the bench's binary) and
    the binary the bare runs use. Sets the environment the members inherit."""
    if args.wireguard_go:
        os.environ[wireguard.BINARY_ENV] = str(Path(args.wireguard_go).resolve())
    info = asyncio.run(wireguard.choose(wireguard.mode_from_env()))
    # The bare runs are wireguard-go's: the same binary nodus0 runs, or the one it would.
    args.wireguard_go = info.binary or wireguard.wireguard_go_binary()
    if args.wireguard_go is None:
        raise RuntimeError("no wireguard-go for the bare runs (deploy/dev/system-deps.sh)")
    version = asyncio.run(wireguard.wireguard_go_version(args.wireguard_go))
    return {
        **msgspec.to_builtins(info),
        "bare": {
            "binary": args.wireguard_go,
            "version": version,
            "offloads": wireguard.has_offloads(version),
        },
    }


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


class BareWireGuard:
    """wireguard-go configured by hand (`wg`), the same binary nodus0 runs, between two
    namespaces: `veth` (two bare namespaces on one veth and nothing else: what the
    implementation itself does on this machine) or `lab` (the lab's two VMs, through the same
    routers and NAT as nodus0, on a port of its own: the lab's hops without the agent)."""

    def __init__(self, binary: str, state: Path, lab: NetLab | None = None) -> None:
        self.binary = binary
        self.state = state
        self.lab = lab
        self.prefix = f"nbw{os.getpid() % 10000}{'l' if lab else 'v'}"
        self.namespaces: list[str] = []
        self.owned: list[str] = []  # namespaces this made (veth), deleted at the end
        self.processes: list[subprocess.Popen[bytes]] = []
        self.devices = [f"{self.prefix}w0", f"{self.prefix}w1"]

    def __enter__(self) -> BareWireGuard:
        try:
            self._start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _underlay(self) -> tuple[list[str], list[str]]:
        """(namespaces, underlay addresses): the client side first, the server side second."""
        if self.lab is not None:
            (a, _, _, a_address, _), (b, _, _, b_address, _) = _machines(2)
            namespaces = [self.lab.topology.machines[b], self.lab.topology.machines[a]]
            return namespaces, [b_address, a_address]
        namespaces = [f"{self.prefix}-0", f"{self.prefix}-1"]
        links = [f"{self.prefix}0", f"{self.prefix}1"]
        addresses = ["198.18.250.1", "198.18.250.2"]
        subprocess.run(["ip", "netns", "add", namespaces[0]], check=True)
        self.owned.append(namespaces[0])
        subprocess.run(["ip", "netns", "add", namespaces[1]], check=True)
        self.owned.append(namespaces[1])
        subprocess.run(
            ["ip", "link", "add", links[0], "type", "veth", "peer", "name", links[1]], check=True
        )
        for namespace, link, address in zip(namespaces, links, addresses, strict=True):
            subprocess.run(["ip", "link", "set", link, "netns", namespace], check=True)
            for step in (
                ["addr", "add", f"{address}/24", "dev", link],
                ["link", "set", link, "up"],
                ["link", "set", "lo", "up"],
            ):
                subprocess.run(["ip", "-n", namespace, *step], check=True)
        return namespaces, addresses

    def _start(self) -> None:
        self.namespaces, underlay = self._underlay()
        meshes = ["100.64.250.1", "100.64.250.2"]
        keys = []
        for side in range(2):
            private = subprocess.run(["wg", "genkey"], capture_output=True, text=True, check=True)
            public = subprocess.run(
                ["wg", "pubkey"], input=private.stdout, capture_output=True, text=True, check=True
            )
            (self.state / f"{self.prefix}-{side}.key").write_text(private.stdout)
            keys.append(public.stdout.strip())
        env = {**os.environ, "WG_I_PREFER_BUGGY_USERSPACE_TO_POLISHED_KMOD": "1"}
        for namespace, device in zip(self.namespaces, self.devices, strict=True):
            argv = ["ip", "netns", "exec", namespace, self.binary, "-f", device]
            self.processes.append(
                subprocess.Popen(
                    argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
            )
        for socket in self.devices:
            deadline = time.monotonic() + 5
            while not Path(f"/var/run/wireguard/{socket}.sock").exists():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"bare wireguard-go {socket} did not start")
                time.sleep(0.02)
        for side in range(2):
            namespace, device, peer = self.namespaces[side], self.devices[side], 1 - side
            # The client side dials (the server side may be behind nothing but the client
            # behind a NAT, as in the lab); the server side learns the endpoint.
            dial = ["endpoint", f"{underlay[peer]}:51830"] if side == 0 else []
            subprocess.run(
                [
                    *("ip", "netns", "exec", namespace, "wg", "set", device),
                    *("private-key", str(self.state / f"{self.prefix}-{side}.key")),
                    *("listen-port", "51830", "peer", keys[peer]),
                    *("allowed-ips", f"{meshes[peer]}/32", *dial),
                ],
                check=True,
            )
            subprocess.run(
                ["ip", "-n", namespace, "addr", "add", f"{meshes[side]}/24", "dev", device],
                check=True,
            )
            subprocess.run(
                ["ip", "-n", namespace, "link", "set", device, "mtu", "1420", "up"], check=True
            )

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]  # `ip netns exec` execs it

    def iperf3(self, seconds: float) -> float:
        server = subprocess.Popen(
            ["ip", "netns", "exec", self.namespaces[1], "iperf3", "-s", "-1", "-B", "100.64.250.2"],
            stdout=subprocess.DEVNULL,
        )
        try:
            time.sleep(0.4)
            client = ["ip", "netns", "exec", self.namespaces[0], "iperf3", "-c", "100.64.250.2"]
            done = subprocess.run(
                [*client, "-t", str(seconds), "--json"],
                capture_output=True,
                text=True,
                timeout=seconds + 30,
            )
            if done.returncode != 0:
                raise RuntimeError(f"iperf3 over bare wireguard-go: {done.stdout[-500:]}")
        finally:
            server.kill()
            server.wait()
        return float(json.loads(done.stdout)["end"]["sum_received"]["bits_per_second"]) / 1e9

    def __exit__(self, *_: object) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        for namespace, device in zip(self.namespaces, self.devices, strict=False):
            if namespace not in self.owned:  # the lab's machine stays; the device goes
                subprocess.run(
                    ["ip", "-n", namespace, "link", "delete", device],
                    check=False,
                    stderr=subprocess.DEVNULL,  # gone with its wireguard-go
                )
        for namespace in self.owned:
            subprocess.run(["ip", "netns", "del", namespace], check=False)
        for device in self.devices:
            Path(f"/var/run/wireguard/{device}.sock").unlink(missing_ok=True)


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def goodput(args: argparse.Namespace, lab: NetLab, members: Members, state: Path) -> dict[str, Any]:
    """iperf3 over eth0, nodus0 and the same wireguard-go set up by hand (one veth, and the
    lab's path), in interleaved rounds: the machine is shared, so each round's ratio is read
    against figures taken moments apart, and the median over rounds is the figure."""
    (a, _, _, a_address, a_mesh), (b, *_) = _machines(2)
    wireguard = _wireguard_pids(lab, a) + _wireguard_pids(lab, b)
    agents = [members.processes[a].pid, members.processes[b].pid]
    paths = ("eth0", "nodus0", "bare_veth", "bare_lab")
    runs: dict[str, list[float]] = {path: [] for path in paths}
    cpu = {path: 0.0 for path in ("nodus0", "bare_veth", "bare_lab", "agents")}
    gbit = {path: 0.0 for path in ("nodus0", "bare_veth", "bare_lab")}
    with (
        BareWireGuard(args.wireguard_go, state) as veth,
        BareWireGuard(args.wireguard_go, state, lab) as on_lab,
    ):
        bare = {"bare_veth": veth, "bare_lab": on_lab}
        for round_ in range(args.rounds):
            shift = round_ % len(paths)  # each path in each position, round after round
            for path in paths[shift:] + paths[:shift]:
                if path in bare:
                    pids = bare[path].pids
                    before = _cpu(pids)
                    rate = bare[path].iperf3(args.seconds)
                    cpu[path] += _cpu(pids) - before
                else:
                    target = a_address if path == "eth0" else a_mesh
                    before, before_agents = _cpu(wireguard), _cpu(agents)
                    rate = _iperf3(lab, b, a, target, args.seconds)
                    if path == "nodus0":
                        cpu["nodus0"] += _cpu(wireguard) - before
                        cpu["agents"] += _cpu(agents) - before_agents
                if path in gbit:
                    gbit[path] += rate * args.seconds
                runs[path].append(round(rate, 3))
                say(f"goodput {path}: {rate:.2f} Gbit/s")
    ratios = {
        f"nodus0_over_{other}": [
            round(n / o, 3) for n, o in zip(runs["nodus0"], runs[other], strict=True) if o
        ]
        for other in ("eth0", "bare_veth", "bare_lab")
    }
    per_gbit = {path: round(cpu[path] / gbit[path], 3) if gbit[path] else None for path in gbit}
    return {
        "gbit_s": runs,
        "best_gbit_s": {path: max(rates) for path, rates in runs.items()},
        "median_gbit_s": {path: _median(rates) for path, rates in runs.items()},
        "ratios_by_round": ratios,
        # Each round's nodus0 over its neighbours, the median of the rounds.
        **{name: _median(values) for name, values in ratios.items()},
        "cpu_s_per_gbit": {
            "wireguard_go": per_gbit["nodus0"],  # nodus0's two wireguard-go processes
            "bare_veth_wireguard_go": per_gbit["bare_veth"],
            "bare_lab_wireguard_go": per_gbit["bare_lab"],
            "agents": round(cpu["agents"] / gbit["nodus0"], 3) if gbit["nodus0"] else None,
        },
        "wireguard_processes": len(wireguard),
    }


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
            first = sum(len(r["paths"]) for r in members.reports.values()) // 2
            failed = {n: r["failures"] for n, r in members.reports.items() if r["failures"]}
            # A pair can end its first round on the relays while its first WireGuard
            # handshake through a NAT is still under way on a loaded machine (CI: 5 of 6);
            # its member moves it to direct once the handshake is done, and that is timed.
            names = [name for name, *_ in machines]
            to_direct = _until(members, names, "direct", 20.0)
            now_direct = sum(p.startswith("direct") for p in _paths(members, names)) // 2
    pairs = count * (count - 1) // 2
    say(f"ice {count} members: {seconds:.1f} s, {first} of {pairs} direct at first")
    return {
        "seconds_to_every_pair": round(seconds, 2),
        "pairs": pairs,
        "direct_pairs_first_round": first,
        "seconds_more_to_every_pair_direct": to_direct,
        "direct_pairs": now_direct,
        "failures": failed,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    reason = lab_unavailable()
    if reason is not None:
        return {"error": f"the lab cannot run here: {reason}"}
    state = Path(tempfile.mkdtemp(prefix="nodus-bench-direct-"))
    result: dict[str, Any] = {
        "params": {
            "seconds": args.seconds,
            "rounds": args.rounds,
            "members": args.members,
            "wireguard_go": args.wireguard_go,
        },
        "machine": machine_facts(),
    }
    started = time.monotonic()
    try:
        result["wireguard"] = wireguard_ran(args)
        say(f"wireguard: {result['wireguard']}")
        machines = _machines(2)
        with _lab(machines, state / "lab.json") as lab:
            spec = [(name, address, mesh) for name, _, _, address, mesh in machines]
            (state / "pair").mkdir()
            with direct_members(lab, state / "pair", spec) as members:
                result["goodput"] = goodput(args, lab, members, state)
                result["fallback"] = fallback(lab, members)
                say(f"fallback: {result['fallback']}")
        result["ice"] = {str(n): ice(n, state) for n in args.members}
    except Exception as error:
        result["error"] = f"{type(error).__name__}: {error}"
        result["state_dir"] = str(state)  # kept to look into
    else:
        shutil.rmtree(state, ignore_errors=True)  # the members' WireGuard keys among it
    result["elapsed_s"] = round(time.monotonic() - started, 1)
    if time.monotonic() - started > args.budget:
        result.setdefault("error", f"over the budget of {args.budget:g} s")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    return bench_main(run, parse_args(argv), lambda: None)


if __name__ == "__main__":
    sys.exit(main())

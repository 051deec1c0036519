"""The whole system on this machine (`nodus up`, `nodus demo`, end-to-end tests): a real
nats-server with JetStream, the services, and one agent per fleet machine, each a process.

With `netns`, each machine is a network namespace of the lab (app/netlab) with its agent in
it, and the bus, relays and services run in the lab's control namespace: VMs get `nodus0`
and the Direct path, machines behind NAT punch through it."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import yaml

import libs
from app.netlab import CONTROL_ADDRESS, NetLab, in_namespace, plan
from libs.bus import Bus
from libs.bus.auth import AGENT, DETECTOR, RELAY, SERVICE
from libs.bus.connection import CREDENTIAL_VARIABLES
from libs.bus.server import NatsCluster, NatsServer, free_port
from libs.contracts import names
from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.fleet import Fleet, NodeHealth, NodeRecord, load_fleet
from libs.contracts.relay import RelayRecord
from services.agent.boot import new_lab_boot
from services.agent.poweroff import power_off

REPO = Path(libs.__file__).resolve().parent.parent
RULES = REPO / "deploy" / "prometheus" / "rules" / "nodus.yml"  # the alert rules (O3)
DEFAULT_FLEET = REPO / "examples" / "fleet.yaml"
SHIM_PATH = REPO / "netshim" / "build" / "libnodus-netshim.so"
# systemd's StartLimitBurst / StartLimitIntervalSec: a daemon that keeps dying is left down.
START_LIMIT_BURST = 5
START_LIMIT_SECONDS = 30.0


@dataclass
class Child:
    name: str
    process: subprocess.Popen[bytes]
    log: Path
    args: list[str] = field(default_factory=list)  # after `python -m app`


def main_region_class(fleet: Fleet | None) -> str:
    """The region class most of the fleet's machines are in (ties: by name)."""
    classes = Counter(m.region_class for m in fleet.machines) if fleet else Counter()
    return min(classes, key=lambda c: (-classes[c], c)) if classes else "local"


@dataclass
class LocalSystem:
    fleet_path: Path = DEFAULT_FLEET
    state_dir: Path = Path(".nodus")
    nats_port: int = names.NATS_PORT
    placers: int = 1
    relays: int = 2
    # Each relay's --region, in order (default: the fleet's most common region class for
    # every relay, so gangs spread over them by load, as relays serving a whole class do).
    relay_regions: list[str] = field(default_factory=list)
    probe_seconds: float = 10.0
    heartbeat_seconds: float = 2.0
    placer_config: Path | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    # The module a daemon runs instead of `app`, by name prefix: only the chaos harness's own
    # tests use it, to start a deliberately broken build (tests/chaos/broken.py).
    module: dict[str, str] = field(default_factory=dict)
    # Extra flags for every relay (benchmarks: `--no-rate-limit`); none by default.
    relay_args: list[str] = field(default_factory=list)
    # Prometheus /metrics for every daemon (O2), listed in STATE_DIR/prometheus/targets.json
    # (file_sd, a `job` label per kind of daemon); the ports by child name in `metrics_ports`.
    metrics: bool = True
    # Debian's Prometheus on targets.json, at 127.0.0.1:`prometheus_port` (0: a free one).
    prometheus: bool = False
    prometheus_port: int = 0
    metrics_ports: dict[str, int] = field(default_factory=dict)
    netns: bool = False
    # Nats-servers: 1, or a cluster of 3 or more (`--nats-cluster 3`) whose streams and buckets
    # keep 3 copies, so the bus outlives any one server; ports nats_port, nats_port+1, ...
    nats_cluster: int = 1
    # External detectors (R8), each a bus user that may only ask repairs and label nodes as
    # itself; seeds at STATE_DIR/detectors/NAME.nk.
    detectors: list[str] = field(default_factory=list)
    nats: NatsServer | NatsCluster | None = None
    children: list[Child] = field(default_factory=list)
    # Supervision (`restart_exited`): when each daemon was started again; those left down.
    starts: dict[str, list[float]] = field(default_factory=dict)
    given_up: set[str] = field(default_factory=set)
    fleet: Fleet | None = None
    lab: NetLab | None = None

    @property
    def url(self) -> str:
        assert self.nats is not None
        return self.nats.url

    def machine_dir(self, name: str) -> Path:
        return self.state_dir / "machines" / name

    def _launcher(self, name: str) -> list[str]:
        """What a child runs under: in the lab, an agent in its machine's namespace and every
        other daemon in the control namespace; nothing without the lab."""
        if self.lab is None:
            return []
        if name.startswith("agent-"):
            return self.lab.machine_argv(name.removeprefix("agent-"), [])
        return in_namespace(self.lab.topology.control, [])

    def metrics_url(self, name: str) -> str | None:
        """Where the child `name` serves /metrics, if it does."""
        port = self.metrics_ports.get(name)
        return f"http://{self._metrics_host(name)}:{port}/metrics" if port else None

    def _metrics_host(self, name: str) -> str:
        """Where a daemon serves /metrics: loopback, or in the lab its namespace's address
        (the control namespace's for the services; an agent's machine address)."""
        if self.lab is None:
            return "127.0.0.1"
        if name.startswith("agent-") and self.fleet is not None:
            machine = name.removeprefix("agent-")
            return next(m.address for m in self.fleet.machines if m.name == machine)
        return str(CONTROL_ADDRESS)

    def credentials(self, name: str) -> str:
        """The child's own bus user (S1): an agent confined to its machine, a relay to its
        own records, the services; its seed at STATE_DIR/machines/NAME/nats.nk for an agent,
        else in the bus's users directory."""
        assert self.nats is not None
        if name.startswith("agent-"):
            machine = name.removeprefix("agent-")
            seed = (self.machine_dir(machine) / "nats.nk").resolve()
            return self.nats.user(name, AGENT, machine, seed_file=seed)
        if name.startswith("relay-"):
            return self.nats.user(name, RELAY, name)
        return self.nats.user(name, SERVICE)

    def _nats_ports(self) -> list[int]:
        if self.nats_cluster > 1:
            return [self.nats_port + i if self.nats_port else 0 for i in range(self.nats_cluster)]
        return [self.nats_port]

    def _start_nats(
        self, ports: list[int], host: str, launcher: list[str] | None
    ) -> NatsServer | NatsCluster:
        store = self.state_dir / "nats"
        if self.nats_cluster > 1:
            fixed = ports if all(ports) else None
            cluster = NatsCluster(store, self.nats_cluster, host, fixed, launcher).start()
            return cluster
        return NatsServer(store, ports[0], host=host, launcher=launcher).start()

    def detector_credentials(self, detector: str) -> str:
        """An external detector's seed (R8): it asks repairs and labels nodes only as itself."""
        assert self.nats is not None
        seed = (self.state_dir / "detectors" / f"{detector}.nk").resolve()
        return self.nats.user(f"detector-{detector}", DETECTOR, detector, seed_file=seed)

    def _spawn(self, name: str, args: list[str]) -> Child:
        if "--credentials" not in args:
            args = [*args, "--credentials", self.credentials(name)]
        if self.metrics and "--metrics-port" not in args:
            port = self.metrics_ports.setdefault(name, free_port())
            host = self._metrics_host(name)
            args = [*args, "--metrics-port", str(port), "--metrics-host", host]
        logs = self.state_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log_path = logs / f"{name}.log"
        env = {
            # Each child has its own bus user: none inherits this shell's.
            **{k: v for k, v in os.environ.items() if k not in CREDENTIAL_VARIABLES},
            "NODUS_NATS_URL": self.url,
            "NODUS_LOG_FORMAT": "json",
            **self.extra_env,
        }
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                [*self._launcher(name), sys.executable, "-m", self._module(name), *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=REPO,
                start_new_session=True,
            )
        child = Child(name, process, log_path, args)
        self.children.append(child)
        return child

    def _module(self, name: str) -> str:
        return next((m for prefix, m in self.module.items() if name.startswith(prefix)), "app")

    def child(self, name: str) -> Child:
        found = next((c for c in self.children if c.name == name), None)
        if found is None:
            raise NodusError(ErrorCode.NOT_FOUND, f"no child {name} in this system")
        return found

    def restart(self, name: str) -> Child:
        """Start a child again with the same arguments (a relay a test SIGKILLed, say); one
        still running is stopped first. Its log continues in the same file."""
        old = self.child(name)
        if old.process.poll() is None:
            old.process.terminate()
            try:
                old.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                old.process.kill()
                old.process.wait()
        index = self.children.index(old)
        self.children.remove(old)
        new = self._spawn(name, old.args)  # the args hold its --metrics-port: targets stand
        self.children.remove(new)
        self.children.insert(index, new)
        return new

    def restart_exited(self) -> list[tuple[str, int | None]]:
        """Every daemon that exited is started again, as systemd's `Restart=always` would: a
        crashed or SIGKILLed agent comes back on the same boot and adopts its ranks and
        dataplanes (O4); a relay's members have moved to the other relay, and its usage
        journal carries what it metered into its next life. One that exits
        `START_LIMIT_BURST` times within `START_LIMIT_SECONDS` is left down (systemd's start
        limit), said once with its exit code None. Returns (name, exit code) of each."""
        changed: list[tuple[str, int | None]] = []
        t = time.monotonic()
        for child in list(self.children):
            code = child.process.poll()
            if code is None or child.name in self.given_up:
                continue
            starts = [s for s in self.starts.get(child.name, []) if t - s < START_LIMIT_SECONDS]
            if len(starts) >= START_LIMIT_BURST:
                self.given_up.add(child.name)
                changed.append((child.name, None))
                continue
            self.starts[child.name] = [*starts, t]
            self.restart(child.name)
            changed.append((child.name, code))
        return changed

    def start_placer(self, index: int) -> Child:
        args = ["placer", "--replica", f"placer-{index}", "--shim-path", str(SHIM_PATH)]
        # The machines of this host share its filesystem: the jobs' checkpoints live here.
        args += ["--checkpoint-root", str((self.state_dir / "checkpoints").resolve())]
        if self.placer_config:
            args += ["--config", str(self.placer_config)]
        return self._spawn(f"placer-{index}", args)

    def start_relays(self) -> None:
        """Two (or more) relays meshed with each other, sharing one mesh key."""
        key_file = self.state_dir / "relay-mesh.key"
        if not key_file.exists():
            key_file.write_bytes(os.urandom(32).hex().encode())
            key_file.chmod(0o600)
        # In the lab the control namespace is fresh: fixed ports, and STUN for Direct members.
        host = str(CONTROL_ADDRESS) if self.lab is not None else "127.0.0.1"
        ports = [4430 + i if self.lab else free_port() for i in range(self.relays)]
        # They share a port for members, as the relays of one host do (443 there): every
        # member's connection may reach another relay first and be handed to its own.
        shared = 443 if self.lab else free_port()
        regions = self.relay_regions or [main_region_class(self.fleet)]
        every = ",".join(f"{host}:{p}" for p in ports)  # each skips its own, as on real hosts
        for index, port in enumerate(ports):
            stun = ["--stun-port", str(3478 + index)] if self.lab is not None else []
            self._spawn(
                f"relay-{index}",
                [
                    "relay",
                    "--name",
                    f"relay-{index}",
                    "--region",
                    regions[index % len(regions)],
                    "--listen",
                    f"{host}:{port}",
                    "--share-port",
                    str(shared),
                    "--mesh-with",
                    every,
                    "--mesh-key-file",
                    str(key_file.resolve()),
                    # Kept across restarts, as a deployed relay's is: a relay started again
                    # holds its name at once (services/relay/announce.py).
                    "--key-file",
                    str((self.state_dir / "relays" / f"relay-{index}.key").resolve()),
                    "--usage-journal",
                    str((self.state_dir / "relays" / f"relay-{index}.usage").resolve()),
                    *stun,
                    *self.relay_args,
                ],
            )

    def start_agent(self, machine: str, socks_port: int) -> Child:
        # The machine powers on: a new boot, and nothing of an earlier run's is adopted. An
        # agent started again by `restart_exited` stays on this boot.
        new_lab_boot(self.machine_dir(machine))
        return self._spawn(
            f"agent-{machine}",
            [
                "agent",
                "--node",
                machine,
                "--fleet",
                str(self.fleet_path.resolve()),
                "--state-dir",
                str(self.machine_dir(machine).resolve()),
                "--heartbeat-seconds",
                str(self.heartbeat_seconds),
                "--socks-listen",
                f"127.0.0.1:{socks_port}",
                # Agents that share this host's network namespace cannot each have a nodus0,
                # nor rules of their own for their private addresses.
                *([] if self.lab is not None else ["--no-nodus0", "--no-port-rules"]),
            ],
        )

    def start_remediation(self, replicas: int = 1) -> None:
        """The remediator and the monitor: the monitor reads each local machine's files under
        `STATE_DIR/machines/NAME/`, the remediator repairs through the local machine provider.
        Persistence and cooldown are short here, for demos (`nodus fault inject`); the
        daemons' defaults are the production ones."""
        state_dir = self.state_dir.resolve()
        for index in range(replicas):
            self._spawn(
                f"remediator-{index}",
                [
                    "remediator",
                    "--replica",
                    f"remediator-{index}",
                    "--state-dir",
                    str(state_dir),
                    "--persistence-seconds",
                    "10",
                    "--cooldown-seconds",
                    "120",
                ],
            )
        self._spawn(
            "monitor",
            [
                "monitor",
                "--state-dir",
                str(state_dir),
                "--fleet",
                str(self.fleet_path.resolve()),
                "--simulate",
            ],
        )

    async def start(self, timeout: float = 60.0) -> None:
        self.fleet = load_fleet(self.fleet_path)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        ports = self._nats_ports()
        if not self.netns:
            for port in ports:
                if port and _port_taken(port):
                    raise NodusError(
                        ErrorCode.INVALID,
                        f"port {port} is taken (another `nodus up`?); pass --nats-port N",
                    )
        if self.netns:
            self.lab = NetLab(plan(self.fleet))
            self.lab.create()
            try:
                self.nats = self._start_nats(
                    [p or names.NATS_PORT + i for i, p in enumerate(ports)],
                    str(CONTROL_ADDRESS),
                    in_namespace(self.lab.topology.control, []),
                )
            except BaseException:
                self.lab.destroy()
                raise
        else:
            self.nats = self._start_nats(ports, "127.0.0.1", None)
        copies = self.nats.replicas if isinstance(self.nats, NatsCluster) else None
        if copies is not None:  # the daemons that create streams and buckets: 3 copies
            self.extra_env.setdefault("NODUS_BUS_REPLICAS", str(copies))
        for detector in self.detectors:
            self.detector_credentials(detector)
        # The placer creates the journal; agents wait for it rather than racing to create it.
        bus = await Bus.open(
            self.url,
            name="nodus-up",
            credentials=self.nats.credentials,
            buckets=names.ALL_BUCKETS,
            streams=True,
            replicas=copies,
        )
        try:
            for index in range(self.placers):
                self.start_placer(index)
            self.start_relays()
            self._spawn(
                "runner-0",
                ["runner", "--replica", "runner-0", "--sample-seconds", str(self.probe_seconds)],
            )
            self.start_remediation()  # node repair: the remediator and the machines' monitor
            for machine in self.fleet.machines:
                self.machine_dir(machine.name).mkdir(parents=True, exist_ok=True)
                self.start_agent(machine.name, free_port())
            self.write_targets()
            if self.prometheus:
                self.start_prometheus()
            await self._wait_ready(bus, timeout)
        except BaseException:
            await bus.close()
            self.stop()
            raise
        await bus.close()

    def write_targets(self) -> Path:
        """STATE_DIR/prometheus/targets.json: every daemon's /metrics, as Prometheus's
        file-based discovery reads it, `job` the daemon's kind (placer, runner, relay, agent,
        remediator, monitor) and `daemon` its name."""
        groups = [
            {
                "targets": [f"{self._metrics_host(name)}:{port}"],
                "labels": {"job": name.split("-", 1)[0], "daemon": name},
            }
            for name, port in sorted(self.metrics_ports.items())
        ]
        directory = self.state_dir / "prometheus"
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / "targets.json"
        scratch = path.with_suffix(".tmp")  # Prometheus never reads a half-written file
        scratch.write_text(json.dumps(groups, indent=2) + "\n")
        scratch.replace(path)
        return path

    @property
    def prometheus_host(self) -> str:
        return str(CONTROL_ADDRESS) if self.lab is not None else "127.0.0.1"

    def start_prometheus(self) -> Child:
        """Debian's Prometheus scraping targets.json every 5 s (`nodus up --prometheus`)."""
        binary = shutil.which("prometheus")
        if binary is None:
            raise NodusError(
                ErrorCode.NOT_FOUND,
                "prometheus is not installed (deploy/dev/system-deps.sh installs Debian's)",
            )
        directory = (self.state_dir / "prometheus").resolve()
        config = directory / "prometheus.yml"
        config.write_text(
            yaml.safe_dump(
                {
                    "global": {"scrape_interval": "5s", "evaluation_interval": "5s"},
                    "rule_files": [str(RULES)],
                    "scrape_configs": [
                        {
                            "job_name": "nodus",
                            "file_sd_configs": [
                                {
                                    "files": [str(directory / "targets.json")],
                                    "refresh_interval": "5s",
                                }
                            ],
                        }
                    ],
                }
            )
        )
        self.prometheus_port = self.prometheus_port or free_port()
        argv = [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={directory / 'data'}",
            f"--web.listen-address={self.prometheus_host}:{self.prometheus_port}",
        ]
        if self.lab is not None:  # the lab's daemons are reached from its control namespace
            argv = in_namespace(self.lab.topology.control, argv)
        log_path = self.state_dir / "logs" / "prometheus.log"
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        child = Child("prometheus", process, log_path, [])
        self.children.append(child)
        return child

    async def _wait_ready(self, bus: Bus, timeout: float) -> None:
        assert self.fleet is not None
        wanted = {m.name for m in self.fleet.machines}
        nodes = bus.bucket(names.BUCKET_NODES, NodeRecord)
        health = bus.bucket(names.BUCKET_HEALTH, NodeHealth)
        relays_bucket = bus.bucket(names.BUCKET_RELAYS, RelayRecord)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_children()
            registered = set(await nodes.snapshot()) & set(await health.snapshot())
            placers = await _count_services(bus, "nodus-placer")
            relays = await relays_bucket.snapshot()
            if wanted <= registered and placers >= self.placers and len(relays) >= self.relays:
                return
            await asyncio.sleep(0.2)
        missing = sorted(wanted - set(await nodes.snapshot()))
        raise NodusError(
            ErrorCode.TIMEOUT,
            f"system not ready within {timeout:g}s; agents missing: {missing or 'none'}; "
            f"logs in {self.state_dir / 'logs'}",
        )

    def _check_children(self) -> None:
        for child in self.children:
            code = child.process.poll()
            if code is not None:
                tail = child.log.read_text(errors="replace").strip().splitlines()[-3:]
                raise NodusError(
                    ErrorCode.INTERNAL,
                    f"{child.name} exited with {code}: {' | '.join(tail)} (log {child.log})",
                )

    def stop(self) -> None:
        for child in self.children:
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for child in self.children:
            try:
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.process.kill()
                child.process.wait()
        self.children.clear()
        # The agents stopped as an upgrade stops them: the machines power off too.
        for machine in self.fleet.machines if self.fleet is not None else []:
            power_off(self.machine_dir(machine.name))
        if self.nats:
            self.nats.stop()
        if self.lab is not None:
            self.lab.destroy()  # and what the ranks left running in the machines
            self.lab = None


async def _count_services(bus: Bus, name: str) -> int:
    """How many instances answer `$SRV.PING.<name>` (NATS micro discovery)."""
    inbox = bus.nc.new_inbox()
    sub = await bus.nc.subscribe(inbox)
    await bus.nc.publish(f"$SRV.PING.{name}", b"", reply=inbox)
    count = 0
    try:
        while True:
            await sub.next_msg(timeout=0.2)
            count += 1
    except Exception:  # timeout: no more answers
        pass
    await sub.unsubscribe()
    return count


def _port_taken(port: int) -> bool:
    import socket

    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False

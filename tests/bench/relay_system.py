"""The Relayed-path bench's systems: a `LocalSystem` with container+VM pairs and one Relayed
job per pair, up once every member's tunnel is; the ways a stream reaches a sink (straight,
through socat hops, through an agent's SOCKS5 entry and the relays); and stopping every
process the bench started, whatever the daemons started too. Used by tests/bench/relay.py
and tests/bench/connect.py."""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml
from cryptography.hazmat.primitives import serialization

from app.local import LocalSystem
from libs.bus.cluster import new_authority
from libs.bus.server import free_port
from libs.client.client import Client
from libs.contracts import names
from libs.contracts.jobs import Job, Phase
from libs.contracts.lifecycle import JoinedEpochsReply, JoinedEpochsRequest
from tests.bench.relay_streams import READ, FlowSpec, Opener, Sink, stream
from tests.bench.running import progress
from tests.bench.sampling import descendants, is_dataplane, kill_left_behind, spawned_below
from tests.factories import job
from tests.socks_client import socks_connect

USAGE_FLUSH = 1.5  # relays publish usage every 100 ms; a restarted one, once it is up
PROBE_SAMPLE = 1.0  # seconds of the runner's throughput sample (G10.2) before measuring
# The ranks: something that runs quietly for longer than the bench, so every gang is Running
# (its epoch live) while it is measured; the agents stop it when they stop.
RANK_COMMAND = ["sleep", "3600"]
ORG = "acme"
SETTLED = {Phase.RUNNING, Phase.SUCCEEDED, Phase.FAILED}
PAIR_HOSTS = ("127.0.4.1", "127.0.4.2")  # A (container), B (VM) of the cap-off system

log = progress("relay")

_systems: list[LocalSystem] = []
_procs: list[subprocess.Popen[bytes]] = []


def cleanup() -> None:
    """Stop everything this bench started; safe to call more than once."""
    while _procs:
        proc = _procs.pop()
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
    while _systems:
        stop_system(_systems.pop())


def stop_system(system: LocalSystem) -> None:
    """`system.stop()`, then SIGKILL whatever its daemons had started (ranks, probes) and
    left behind: by pid, and only the very processes seen before the stop."""
    roots = [c.process.pid for c in system.children if c.process.poll() is None]
    spawned = spawned_below(roots)
    system.stop()
    kill_left_behind(spawned)


# The AEAD WireGuard seals with; TLS 1.2 because socat sets no TLS 1.3 suites.
SEALED = "max-version=TLS1.2,cipher=ECDHE-ECDSA-CHACHA20-POLY1305,verify=0"


def spawn_socat(port: int, target: str, listen: str = "TCP-LISTEN") -> subprocess.Popen[bytes]:
    """`listen`: the listening address type and, after a comma, any options of its own."""
    kind, _, options = listen.partition(",")
    return subprocess.Popen(
        [
            "socat",
            f"{kind}:{port},bind=127.0.0.1,fork,reuseaddr{',' + options if options else ''}",
            target,
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def pair_machines(index: int, a: str, b: str, model: str) -> list[dict[str, Any]]:
    """A container-only machine and a VM with an accelerator model only they have."""
    common = {
        "region": "eu-central-1",
        "regionClass": "eu",
        "pool": f"bench-{index}",
        "cluster": "eu",
        "accelerators": {"count": 1, "backend": "cuda", "model": model},
    }
    return [
        {"name": f"vast-{index}", "provider": "vast", "offering": "container", "address": a}
        | common,
        {"name": f"lam-{index}", "provider": "lambda", "offering": "vm", "address": b} | common,
    ]


@dataclass
class Gang:
    name: str
    nodes: tuple[str, str]  # (A the container, B the VM)
    hosts: tuple[str, str]
    socks: tuple[tuple[str, int], tuple[str, int]] = (("", 0), ("", 0))
    sinks: tuple[Sink, Sink] | None = None
    homes: dict[str, str | None] = field(default_factory=dict)
    relays: list[str] = field(default_factory=list)  # the two the placer chose (its status)
    lifecycle: dict[str, Any] = field(default_factory=dict)


def lifecycle(found: Job) -> dict[str, Any]:
    """Where the job's life stood when measuring began, and the runner's own measurement of
    the pair (G11: the slowest pair of a short sample through the same path)."""
    status = found.status
    out: dict[str, Any] = {"phase": status.phase.value, "epoch": status.epoch}
    probe = status.gang.probe if status.gang else None
    if probe is not None:
        out["probe"] = {"tcp_gbps": probe.tcp_gbps, "rtt_ms": probe.rtt_ms, "path": probe.path}
    if status.phase is not Phase.RUNNING:
        out["conditions"] = [f"{c.type}={c.status}: {c.message}" for c in status.conditions]
    return out


class Bench:
    def __init__(self, args: argparse.Namespace, state: Path) -> None:
        self.args = args
        self.state = state
        self.client: Client | None = None
        self.system: LocalSystem | None = None

    async def up(
        self,
        name: str,
        gangs: int,
        relay_args: list[str],
        placer_config: Path | None = None,
        relays: int = 2,
    ) -> list[Gang]:
        """A LocalSystem with `gangs` container+VM pairs, `relays` relays and one Relayed job
        per pair; returns once every member's tunnel is up (its agent reports the relay it
        uses). `placer_config`: another placer config file (the stock one by default)."""
        machines: list[dict[str, Any]] = []
        plan: list[Gang] = []
        for index in range(gangs):
            hosts = (
                PAIR_HOSTS
                if gangs == 1
                else (f"127.0.5.{2 * index + 1}", f"127.0.5.{2 * index + 2}")
            )
            machines += pair_machines(index, *hosts, model=f"L4-bench-{index}")
            plan.append(Gang(f"bench-{index}", (f"vast-{index}", f"lam-{index}"), hosts))
        root = self.state / name
        root.mkdir(parents=True)
        fleet = root / "fleet.yaml"
        fleet.write_text(yaml.safe_dump({"machines": machines}))
        system = LocalSystem(
            fleet_path=fleet,
            state_dir=root / "state",
            nats_port=free_port(),
            heartbeat_seconds=1.0,
            probe_seconds=PROBE_SAMPLE,
            relay_args=relay_args,
            placer_config=placer_config,
            relays=relays,
        )
        _systems.append(system)
        self.system = system
        started = time.monotonic()
        await system.start(timeout=120)
        self.client = client = await Client.connect(system.url)
        for index, gang in enumerate(plan):
            await client.apply(
                job(
                    gang.name,
                    org=ORG,
                    accelerators={"model": f"L4-bench-{index}"},
                    distributed={"members": 2, "transport": "Auto"},
                    command=RANK_COMMAND,
                )
            )
        # The gang's life first: the runner's readiness probe and throughput sample go
        # through the same tunnels, so nothing is measured until every job is past probing.
        deadline = time.monotonic() + 180
        while True:
            jobs = [await client.get_job(g.name) for g in plan]
            homes = await self.homes([n for g in plan for n in g.nodes])
            if all(j.status.phase in SETTLED for j in jobs) and all(homes.values()):
                break
            if time.monotonic() > deadline:
                phases = {j.metadata.name: j.status.phase.value for j in jobs}
                raise RuntimeError(
                    f"gangs not probed and running within 180 s: {phases}, tunnels {homes}; "
                    f"logs in {root}"
                )
            await asyncio.sleep(0.2)
        for gang, found in zip(plan, jobs, strict=True):
            gang.lifecycle = lifecycle(found)
            gang.relays = list(found.status.gang.relays) if found.status.gang else []
        await asyncio.sleep(USAGE_FLUSH)  # the probes' last bytes, metered before any measure
        records = {r.inventory.node: r for r, _, _ in await client.list_nodes()}
        for gang in plan:
            endpoints = [records[n].socks_endpoint.rpartition(":") for n in gang.nodes]
            gang.socks = (
                (endpoints[0][0], int(endpoints[0][2])),
                (endpoints[1][0], int(endpoints[1][2])),
            )
            gang.sinks = (Sink(gang.hosts[0]), Sink(gang.hosts[1]))
            for sink in gang.sinks:
                await sink.start()
            gang.homes = {n: homes[n] for n in gang.nodes}
        log(f"{name}: {gangs} Relayed gang(s) up in {time.monotonic() - started:.1f} s")
        return plan

    async def down(self) -> None:
        if self.client is not None:
            await self.client.close()
            self.client = None
        if self.system is not None:
            _systems.remove(self.system)
            stop_system(self.system)
            self.system = None

    async def joined(self, node: str) -> str | None:
        assert self.client is not None
        reply = await self.client.bus.request(
            names.node_request(node, names.AgentVerb.EPOCHS),
            JoinedEpochsRequest(),
            JoinedEpochsReply,
            timeout=2.0,
        )
        return reply.epochs[0].relay if reply.epochs else None

    async def homes(self, nodes: list[str]) -> dict[str, str | None]:
        found = await asyncio.gather(*(self.joined(n) for n in nodes))
        return dict(zip(nodes, found, strict=True))

    async def billed(self, gangs: list[Gang]) -> int:
        """Bytes the relays metered as sent by these gangs' members (the usage stream, G17)."""
        assert self.client is not None
        usage = await self.client.usage()
        return sum(usage.get(f"{ORG}.{g.name}", 0) for g in gangs)

    async def relayed(
        self, gangs: list[Gang], specs: list[FlowSpec], **kwargs: Any
    ) -> dict[str, Any]:
        """`stream` through the relays, plus what the relays billed the gangs for it: the
        WireGuard messages their members sent (acknowledgements, keepalives and any resend
        included) over the bytes delivered. Relays flush usage every second: this waits."""
        before = await self.billed(gangs)
        measure = await stream(specs, **kwargs)
        await asyncio.sleep(USAGE_FLUSH)
        delivered = sum(f["received_bytes"] for f in measure["flows"].values())
        billed = await self.billed(gangs) - before
        measure["billed_bytes"] = billed
        measure["billed_over_delivered"] = round(billed / delivered, 4) if delivered else None
        return measure

    def pids(self, *names_: str) -> list[int]:
        assert self.system is not None
        return [c.process.pid for c in self.system.children if c.name in names_]

    def gang_procs(self, gang: Gang) -> dict[str, list[int]]:
        """The processes that carry a gang's bytes: each member's agent and the dataplane it
        runs the tunnel in (a process of its own, below the agent), and every relay."""
        procs: dict[str, list[int]] = {}
        for node in gang.nodes:
            agent = self.pids(f"agent-{node}")
            procs[f"agent-{node}"] = agent
            procs[f"dataplane-{node}"] = [p for p in descendants(agent) if is_dataplane(p)]
        procs |= {r: self.pids(r) for r in self.relay_names()}
        return procs

    def relay_names(self) -> list[str]:
        assert self.system is not None
        return [c.name for c in self.system.children if c.name.startswith("relay-")]

    # -- openers -------------------------------------------------------------------------------

    @staticmethod
    def via_socks(socks: tuple[str, int]) -> Opener:
        async def open_(sink: Sink) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            code, reader, writer = await socks_connect(socks, sink.host, sink.port)
            if code != 0:
                writer.close()
                raise RuntimeError(f"SOCKS5 CONNECT to {sink.host}:{sink.port} refused: {code}")
            return reader, writer

        return open_

    @staticmethod
    def direct(source: str) -> Opener:
        async def open_(sink: Sink) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            return await asyncio.open_connection(
                sink.host, sink.port, local_addr=(source, 0), limit=READ
            )

        return open_

    @staticmethod
    def to(host: str, port: int) -> Opener:
        async def open_(_: Sink) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            return await asyncio.open_connection(host, port, limit=READ)

        return open_

    def _certificate(self) -> tuple[Path, Path]:
        """A self-signed certificate for the sealed chain's opening hop (made once)."""
        cert, key = self.state / "sealed-chain.crt", self.state / "sealed-chain.key"
        if not cert.exists():
            private, certificate = new_authority(datetime.now(UTC))
            key.write_bytes(
                private.private_bytes(
                    serialization.Encoding.PEM,
                    serialization.PrivateFormat.PKCS8,
                    serialization.NoEncryption(),
                )
            )
            cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        return cert, key

    async def socat_chain(
        self, hops: int, sink: Sink, sealed: bool = False
    ) -> tuple[int, list[int]]:
        """`hops` socat relays in a row in front of `sink`; returns the first port and pids.
        Started from the last hop back, each probed before the next starts. `sealed` (at
        least 2 hops): the first hop seals what it forwards with ChaCha20-Poly1305 (TLS) and
        the last opens it, as the members' dataplanes do; the hops between carry it sealed,
        as relays do."""
        if sealed and hops < 2:
            raise ValueError(f"a sealed chain seals at one hop and opens at another, not {hops}")
        target, pids = f"TCP:{sink.host}:{sink.port}", []
        port = 0
        for hop in range(hops):
            port = free_port()
            listen = "TCP-LISTEN"
            if sealed and hop == 0:  # the hop next to the sink opens
                cert, key = self._certificate()
                listen = f"OPENSSL-LISTEN,cert={cert},key={key},{SEALED}"
            if sealed and hop == hops - 1:  # the first hop seals
                target = f"OPENSSL{target.removeprefix('TCP')},{SEALED}"
            proc = spawn_socat(port, target, listen)
            _procs.append(proc)
            pids.append(proc.pid)
            for _attempt in range(200):
                try:
                    _, writer = await asyncio.open_connection("127.0.0.1", port)
                    writer.close()  # a probe: no flow id, the sink ignores it
                    break
                except OSError:
                    if proc.poll() is not None:
                        raise RuntimeError(f"socat exited with {proc.returncode}") from None
                    await asyncio.sleep(0.025)
            else:
                raise RuntimeError(f"socat did not listen on {port}")
            target = f"TCP:127.0.0.1:{port}"
        return port, pids

    # -- the measurements ----------------------------------------------------------------------

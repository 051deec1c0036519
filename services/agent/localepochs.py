"""The epochs this node joined, as they run here: each one's dataplane (a process of its own
that outlives the agent, or, for agents inside a test's process, in this process) and, on a
private network, its port rules (G22). A dataplane that cannot start is its epoch's failure,
not the agent's: said in the node's status, tried again with a growing pause."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from prometheus_client import Counter

from libs.bus import Bus
from libs.contracts.dataplane import DataplaneSpec, EpochState
from libs.contracts.epochs import Epoch, EpochMember
from libs.contracts.errors import NodusError
from libs.contracts.jobs import PathClass
from libs.runtime.tasks import TaskSet
from services.agent.dataplane.store import EpochStore
from services.agent.dataplane.supervisor import Dataplane, Launch, ProcessDataplane
from services.agent.private.member import PortRules, PrivateMember, ephemeral_range

log = logging.getLogger("nodus.agent")

DATAPLANES = Counter(
    "nodus_agent_dataplanes_total",
    "Epoch dataplanes by outcome (started, adopted, restarted, failed, killed: another boot's)",
    ["node", "outcome"],
)

RETRY_FIRST, RETRY_MOST = 1.0, 30.0  # a dataplane that keeps failing is started less often


@dataclass
class LocalEpoch:
    """An epoch this node joined, as it runs here."""

    state: EpochState
    wg_private: bytes
    since: float  # loop time it became local: a read of the bus older than this cannot end it
    dataplane: Dataplane | None = None
    private: PrivateMember | None = None
    starting: asyncio.Task[None] | None = None
    failures: int = 0
    retry_at: float = 0.0
    adopted: bool = False  # from disk: its member record and introductions are made sure of

    @property
    def gang(self) -> str:
        return self.state.joined.gang

    @property
    def epoch(self) -> int:
        return self.state.joined.epoch


@dataclass(frozen=True)
class Host:
    """What the agent's machine offers an epoch's dataplane."""

    node: str
    underlay: str  # the machine's own address (Direct's WireGuard endpoint)
    socks_endpoint: str  # the shim's SOCKS5 entry (Relayed)
    nodus0: bool  # Direct epochs get a nodus0 device here
    port_rules: bool  # on a private network: its rules are the agent's (G22)
    region: str = ""
    region_class: str = ""


class LocalEpochs:
    def __init__(
        self,
        bus: Bus,
        host: Host,
        launch: Launch | None,
        store: EpochStore | None,
        boot_id: Callable[[], str],
        member_of: Callable[[Epoch], EpochMember],
        report_failing: Callable[[str, str | None], Awaitable[None]],
    ) -> None:
        self.bus = bus
        self.host = host
        self.launch = launch
        self.store = store
        self._boot_id = boot_id
        self._member_of = member_of
        self._report_failing = report_failing
        self.local: dict[str, LocalEpoch] = {}  # joinkey key -> the epoch as it runs here
        self._starting = TaskSet("agent dataplane start", log)

    async def close(self) -> None:
        await self._starting.close()

    def spawn(self, work: Coroutine[Any, Any, None], name: str) -> None:
        self._starting.spawn(work, name=name)

    def spec(self, epoch: Epoch) -> DataplaneSpec | None:
        """On the Relayed path: the tunnel through the relays and the SOCKS5 entry (G14); on
        the Direct path: nodus0 and ICE with every peer (G7, G11). The Private path's port
        rules are kernel state the agent writes itself (G22)."""
        host = self.host
        kind: Literal["relayed", "direct"]
        if epoch.path is PathClass.RELAYED:
            kind, socks_listen, underlay = "relayed", host.socks_endpoint, None
        elif epoch.path is PathClass.DIRECT and host.nodus0:
            kind, socks_listen, underlay = "direct", "", host.underlay
        else:
            return None
        return DataplaneSpec(
            kind=kind,
            node=host.node,
            socks_listen=socks_listen,
            underlay=underlay,
            region=host.region,
            region_class=host.region_class,
        )

    def port_rules(self, epoch: Epoch) -> PortRules:
        member = self._member_of(epoch)
        return PortRules(
            gang=epoch.gang,
            epoch=epoch.epoch,
            interface=member.interface,
            members=tuple(m.address for m in epoch.members if m.node != self.host.node),
            rendezvous_port=int(member.env.get("MASTER_PORT", "29500")),
            ephemeral=ephemeral_range(),
        )

    def start(self, key: str, local: LocalEpoch, outcome: str) -> None:
        local.starting = self._starting.spawn(
            self._run(key, local, outcome),
            name=f"dataplane {local.gang} epoch {local.epoch}",
        )

    async def stop(self, local: LocalEpoch) -> None:
        if local.starting is not None and not local.starting.done():
            local.starting.cancel()  # the epoch ended while its dataplane started
            try:
                await local.starting
            except BaseException:  # its end is the point
                pass
        if local.dataplane is not None:
            await local.dataplane.stop()
            local.dataplane = None
        if local.private is not None:
            await local.private.stop()
            local.private = None

    async def path_of(self, gang: str, epoch: int, peer: str) -> str | None:
        """The path to `peer` the workload's bytes take now: the tunnel's relay on the
        Relayed path; on the Direct path, once the pair's first checks ended, `direct` or
        the relay that carries it."""
        local = next((e for e in self.local.values() if (e.gang, e.epoch) == (gang, epoch)), None)
        if local is None:
            return None
        if local.starting is not None and not local.starting.done():
            await asyncio.wait({local.starting})  # the probe asked as the dataplane came up
        if local.dataplane is None:
            return None
        try:
            return await local.dataplane.path_to(peer)
        except NodusError as error:  # the dataplane is away: the probe says so
            log.warning("%s epoch %d: no path to %s: %s", gang, epoch, peer, error)
            return None

    def address_never_up(self, gang: str, epoch: int) -> str | None:
        """Why the member's address of a Direct epoch can never come up here (it lives on
        `nodus0`, and this machine makes none), or None: the probe then fails at once instead
        of waiting for the address."""
        local = next((e for e in self.local.values() if (e.gang, e.epoch) == (gang, epoch)), None)
        if local is None or local.state.epoch.path is not PathClass.DIRECT:
            return None
        if self.host.nodus0:
            return None
        return f"{self.host.node} makes no nodus0 for a Direct epoch (its agent runs without one)"

    def inline(self, kind: str) -> dict[str, object]:
        """The dataplanes of `kind` that run in this process and are up (tests look inside)."""
        found: dict[str, object] = {}
        for key, local in self.local.items():
            dataplane = local.dataplane
            if getattr(dataplane, "kind", None) == kind and getattr(dataplane, "ready", False):
                found[key] = dataplane.runtime  # type: ignore[union-attr]
        return found

    def sockets(self) -> list[Path]:
        """The control sockets of the dataplane processes (their metrics are read there)."""
        return [
            e.dataplane.socket
            for e in list(self.local.values())
            if isinstance(e.dataplane, ProcessDataplane)
        ]

    async def _run(self, key: str, local: LocalEpoch, outcome: str) -> None:
        """Start one epoch's dataplane. One that cannot start is this epoch's failure, not the
        agent's: said, tried again later (the reconcile), and left to the probe, which fails
        the epoch (G12)."""
        try:
            if local.state.epoch.path is PathClass.PRIVATE and self.host.port_rules:
                private = PrivateMember(self.port_rules(local.state.epoch))
                await private.start()
                local.private = private
                return
            if local.state.dataplane is None:
                return
            dataplane = self._new_dataplane(key, local)
            local.dataplane = dataplane
            try:
                await dataplane.start()
            except BaseException:
                if local.dataplane is dataplane:
                    local.dataplane = None
                await dataplane.stop()
                raise
            local.failures = 0
            DATAPLANES.labels(self.host.node, outcome).inc()
            await self._report_failing(key, None)
        except (NodusError, OSError, TimeoutError) as error:
            local.failures += 1
            pause = min(RETRY_MOST, RETRY_FIRST * 2 ** (local.failures - 1))
            local.retry_at = asyncio.get_running_loop().time() + pause
            DATAPLANES.labels(self.host.node, "failed").inc()
            said = (
                f"{local.gang} epoch {local.epoch}: the dataplane did not start "
                f"({local.failures} tries, the next in {pause:.0f} s): {error}"
            )
            log.warning("%s", said)
            await self._report_failing(key, said)
        finally:
            local.starting = None

    def _new_dataplane(self, key: str, local: LocalEpoch) -> Dataplane:
        if self.launch is not None and self.store is not None:
            return ProcessDataplane.spawn(self.launch, self.store, key, self._boot_id())
        # Imported here: the agent daemon runs dataplanes in processes, and their metric
        # families must be the processes' alone on its /metrics.
        from services.agent.dataplane.inline import InlineDataplane

        return InlineDataplane.build(self.bus, local.state, local.wg_private)

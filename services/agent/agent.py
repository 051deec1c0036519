"""The per-machine agent: registers inventory, version and capabilities (T1, C6), heartbeats,
answers requests addressed to its node (C1), and joins the epochs its join keys name (G9).

It is a reconcile loop (O4): the epochs the bus says this node belongs to (its join keys in
`nodus-joinkeys`, a deleted one meaning fenced or ended) are compared, at start, on every
watch event and every few seconds, with what runs here (the epochs persisted under
`STATE/epochs/`, their dataplanes and port rules): an epoch on disk whose key is live is
adopted (its dataplane process reconnected, or started again from the persisted key if it
died), one whose key is gone is stopped and forgotten, a new key is joined. An agent that
stops (an upgrade, a crash) leaves dataplanes and ranks running for the next one; another
boot's are killed, not adopted."""

from __future__ import annotations

import asyncio
import logging
import tempfile
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
from nats.errors import Error as NatsError
from prometheus_client import REGISTRY, Counter, Gauge

from libs.bus import Bucket, Bus, Endpoint
from libs.contracts import names
from libs.contracts.api import NodeInfoReply, NodeInfoRequest
from libs.contracts.base import now
from libs.contracts.bounds import (
    HEARTBEAT_TIMEOUT_SECONDS,
    HEARTBEATS_PER_TIMEOUT,
    TUNNEL_BUFFER_LIMIT_BYTES,
)
from libs.contracts.dataplane import EpochState
from libs.contracts.epochs import JoinKeyGrant
from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.fleet import Machine, NodeRecord, WireGuardInfo
from libs.contracts.jobs import PathClass
from libs.contracts.lifecycle import JoinedEpoch, JoinedEpochsReply, JoinedEpochsRequest
from libs.contracts.providers import HealthCheckRequest, HostRebootRequest
from libs.contracts.remediation import RebootReply, RebootRequest
from libs.runtime.tasks import cancel_and_wait
from libs.runtime.version import VERSION as AGENT_VERSION
from libs.wg import generate_private_key
from services.agent.boot import BootIdentity, machine_boot, new_lab_boot
from services.agent.dataplane.store import EpochStore, Stored
from services.agent.dataplane.supervisor import (
    DataplaneMetrics,
    Launch,
    ProcessDataplane,
    dataplane_families,
    kill_stale,
)
from services.agent.direct.wireguard import for_agent
from services.agent.gangwork import GangWork
from services.agent.health import AgentHealth
from services.agent.heartbeat import Heartbeat
from services.agent.hostpower import DEFAULT_COMMAND as DEFAULT_REBOOT_COMMAND
from services.agent.hostpower import HostPower, drain_ranks
from services.agent.inventory import Described, capabilities_of, inventory_of
from services.agent.localepochs import DATAPLANES, Host, LocalEpoch, LocalEpochs
from services.agent.membership import Membership
from services.agent.private.member import PrivateMember

if TYPE_CHECKING:  # not imported at run time: their metrics are the dataplane processes'
    from services.agent.direct.member import DirectMember
    from services.agent.relayed.member import RelayedMember

log = logging.getLogger("nodus.agent")

JOINS = Counter(
    "nodus_agent_epoch_joins_total", "Join keys handled by outcome", ["node", "outcome"]
)
JOINED = Gauge("nodus_agent_joined_epochs", "Epochs this node is a member of", ["node"])

RECONCILE_SECONDS = 3.0  # the periodic pass: what the watch missed, dataplanes that died


class Agent:
    def __init__(
        self,
        bus: Bus,
        machine: Machine | Described,
        heartbeat_seconds: float = HEARTBEAT_TIMEOUT_SECONDS / HEARTBEATS_PER_TIMEOUT,
        socks_endpoint: str = "",
        tunnel_buffer_limit_bytes: int = TUNNEL_BUFFER_LIMIT_BYTES,
        state_dir: Path | None = None,
        nodus0: bool = False,
        port_rules: bool = False,
        restart: Callable[[], None] | None = None,
        dataplanes: Launch | None = None,
        host_reboot: bool = False,
        reboot_command: Sequence[str] = DEFAULT_REBOOT_COMMAND,
    ) -> None:
        self.bus = bus
        self.instance = uuid.uuid4().hex  # this process's run of the agent (NodeInfoReply)
        # How epochs' dataplanes run: each in a process of its own that outlives this agent
        # (the daemon), or, without a bus URL to hand a child (agents made inside a test's
        # process), in this process.
        self.launch = dataplanes
        # How a reboot request boots this machine: the daemon starts again (a new process, a
        # new boot id; ranks and tunnels gone). Without one (in-process agents of the tests)
        # only the boot id changes.
        self.restart = restart
        if isinstance(machine, Machine):  # a machine of the fleet file (the lab)
            self.inventory, self.capabilities = inventory_of(machine), capabilities_of(machine)
        else:  # a machine that described itself (O1)
            self.inventory, self.capabilities = machine.inventory, machine.capabilities
        self.node = self.inventory.node
        # Direct epochs get a nodus0 here: a VM's agent with its own network namespace (a
        # machine, or a machine of the lab); agents that share one namespace cannot.
        self.nodus0 = nodus0 and self.inventory.offering == "vm"
        self.port_rules = port_rules  # on a private network: its rules are this agent's (G22)
        self.wireguard: WireGuardInfo | None = None  # what nodus0 runs (O5), chosen at start
        # The kernel's boot on a real machine; a lab machine's own, kept in its state directory
        # (O4): an agent started again on the same boot re-adopts what it left running.
        self.boot = machine_boot(isinstance(machine, Machine), state_dir)
        self.socks_endpoint = socks_endpoint or names.SOCKS_ENDPOINT
        self.tunnel_buffer_limit_bytes = tunnel_buffer_limit_bytes
        self.nodes = bus.bucket(names.BUCKET_NODES, NodeRecord)
        self.joinkeys = bus.bucket(names.BUCKET_JOINKEYS, JoinKeyGrant)
        self.heartbeat = Heartbeat(bus, self.node, lambda: self.boot_id, heartbeat_seconds)
        self.membership = Membership(bus, self.node)
        # Desired: the join keys the bus holds for this node (joinkey key -> grant), and when
        # the watch last said so. Observed: the epochs that run here (self.epochs.local).
        self.grants: dict[str, JoinKeyGrant] = {}
        self._granted_at: dict[str, float] = {}
        self._refused: dict[str, str] = {}  # joinkey key -> the token refused (not retried)
        self._lock = asyncio.Lock()  # one reconcile step at a time
        self._tasks: list[asyncio.Task[None]] = []
        self.state_dir = state_dir
        if dataplanes is not None and state_dir is None:  # a process needs a directory
            state_dir = Path(tempfile.mkdtemp(prefix=f"nodus-{self.node}-"))
        state = state_dir or Path(tempfile.gettempdir()) / "nodus" / self.node
        # An agent without a state directory cannot start again on the same boot: nothing
        # of its epochs is kept.
        self.store = EpochStore(state_dir) if state_dir is not None else None
        host = Host(
            self.node,
            self.inventory.address,
            self.socks_endpoint,
            self.nodus0,
            port_rules,
            self.inventory.region,
            self.inventory.region_class,
        )
        self.epochs = LocalEpochs(
            bus,
            host,
            dataplanes,
            self.store,
            lambda: self.boot_id,
            self.membership.member_of,
            self.heartbeat.report_failing,
        )
        self.local = self.epochs.local
        self._metrics = DataplaneMetrics(
            self.epochs.sockets, dataplane_families() if dataplanes is not None else ()
        )
        self.gangs = GangWork(
            bus,
            self.node,
            state / "logs",
            self.epochs.path_of,
            self.membership.joined_epoch,
            scratch_dir=state / "scratch" if state_dir else None,
            address_never_up=self.epochs.address_never_up,
        )
        # Repairs that reach the real machine (R18): in-band reboot (off unless enabled) and
        # the agent's part of revalidation.
        self.hostpower = HostPower(
            self.node,
            host_reboot,
            lambda grace: drain_ranks(self.gangs.runner, grace),
            reboot_command,
            state / "host-reboot.op" if state_dir else None,
        )
        self.health_check = AgentHealth(self.node, state)

    @property
    def relayed(self) -> dict[str, RelayedMember]:
        """The Relayed dataplanes that run in this process and are up (tests look inside)."""
        return self.epochs.inline("relayed")  # type: ignore[return-value]

    @property
    def direct(self) -> dict[str, DirectMember]:
        return self.epochs.inline("direct")  # type: ignore[return-value]

    @property
    def private(self) -> dict[str, PrivateMember]:
        return {key: e.private for key, e in self.local.items() if e.private is not None}

    @property
    def failing(self) -> dict[str, str]:
        return self.heartbeat.failing

    def record(self) -> NodeRecord:
        return NodeRecord(
            inventory=self.inventory,
            agent_version=AGENT_VERSION,
            capabilities=self.capabilities,
            registered_time=now(),
            boot_id=self.boot_id,
            socks_endpoint=self.socks_endpoint,
            tunnel_buffer_limit_bytes=self.tunnel_buffer_limit_bytes,
            wireguard=self.wireguard,
        )

    async def start(self) -> None:
        verb, node = names.AgentVerb, self.node
        await self.bus.serve(
            "nodus-agent",
            AGENT_VERSION,
            f"Agent of machine {self.node}",
            [
                Endpoint.of_agent(node, verb.INFO, NodeInfoRequest, self.info),
                Endpoint.of_agent(node, verb.EPOCHS, JoinedEpochsRequest, self.epochs_joined),
                *self.gangs.endpoints(),
                Endpoint.of_agent(node, verb.REBOOT, RebootRequest, self.reboot),
                # R18: the remediator's in-band reboot and revalidation on this machine
                Endpoint.of_agent(
                    node,
                    verb.HOST_REBOOT,
                    HostRebootRequest,
                    lambda request: self.hostpower.reboot(request, self.boot_id),
                ),
                Endpoint.of_agent(
                    node,
                    verb.HEALTH,
                    HealthCheckRequest,
                    lambda request: self.health_check.check(request, self.boot_id),
                ),
            ],
        )
        await self.gangs.runner.resume(self.boot)
        await self._read_back()
        if self.launch is not None:
            REGISTRY.register(self._metrics)
        if self.nodus0:
            self.wireguard = await for_agent(self.node)
        await self.nodes.put(self.node, self.record())
        await self.heartbeat.beat()
        await self._reconcile_all()  # before the first heartbeat interval: fenced ones stop
        self._tasks = [
            asyncio.create_task(self.heartbeat.run()),
            asyncio.create_task(self._watch_grants()),
            asyncio.create_task(self._reconcile_periodically()),
        ]
        log.info("agent %s registered (boot %s)", self.node, self.boot_id)

    async def stop(self, keep_workloads: bool = False) -> None:
        """Stop the agent. `keep_workloads`: the machine goes on (an upgrade, a restart of the
        daemon, O4): the ranks, the dataplane processes and the port rules stay for the next
        agent, which re-adopts them. Otherwise everything of this agent's epochs ends."""
        await cancel_and_wait(self._tasks)
        await self.epochs.close()
        if self.launch is not None:
            try:
                REGISTRY.unregister(self._metrics)
            except KeyError:  # never registered: start failed early
                pass
        await self.gangs.close(keep_ranks=keep_workloads)
        for key, local in list(self.local.items()):
            if keep_workloads:
                if local.dataplane is not None:
                    await local.dataplane.detach()
                continue
            await self.epochs.stop(local)
            if self.store is not None:
                self.store.remove(key)
        self.local.clear()

    @property
    def boot_id(self) -> str:
        return self.boot.boot_id

    async def reboot(self, _: RebootRequest) -> RebootReply:
        """The lab's machine boots again: a new boot id in its state directory, and the agent
        restarts; the new agent stops what the old boot ran and registers with the new id (the
        answer goes first, so the provider knows the boot began). A real machine is rebooted
        by its pool's provider, not by this request."""
        if not self.boot.simulated:
            raise NodusError(
                ErrorCode.INVALID,
                f"{self.node} is a real machine: its pool's provider reboots it, not the lab's",
            )
        if self.restart is not None and self.state_dir is not None:
            log.info("agent %s reboots: its ranks and tunnels stop, it starts again", self.node)
            new_lab_boot(self.state_dir)
            asyncio.get_running_loop().call_later(0.05, self.restart)
            return RebootReply(node=self.node, boot_id="")
        self.boot = BootIdentity(str(uuid.uuid4()), simulated=True)
        await self.nodes.put(self.node, self.record())
        await self.heartbeat.beat()
        return RebootReply(node=self.node, boot_id=self.boot_id)

    async def info(self, _: NodeInfoRequest) -> NodeInfoReply:
        return NodeInfoReply(
            node=self.record(), agent_instance=self.instance, probing=sorted(self.gangs.probing)
        )

    async def epochs_joined(self, _: JoinedEpochsRequest) -> JoinedEpochsReply:
        epochs = []
        for key, joined in list(self.membership.joined.items()):
            local = self.local.get(key)
            home = None
            if local is not None and local.dataplane is not None:
                try:
                    home = await local.dataplane.home()
                except NodusError:  # the dataplane is away: the membership still holds
                    home = None
            if home is not None:
                joined = msgspec.structs.replace(joined, path=home[0], relay=home[1])
            epochs.append(joined)
        return JoinedEpochsReply(node=self.node, epochs=epochs)

    # -- the reconcile loop ----------------------------------------------------------------

    async def _watch_grants(self) -> None:
        """The fast path: each change of this node's join keys is reconciled at once."""
        async for change in self.joinkeys.watch(f"{self.node}.>"):
            loop = asyncio.get_running_loop()
            value = change.value
            if value is None and change.key in self.local:
                value = await key_itself(self.joinkeys, change.key, self.grants)
            if value is None:
                self.grants.pop(change.key, None)
            else:
                self.grants[change.key] = value
            self._granted_at[change.key] = loop.time()
            await self._reconcile(change.key)

    async def _reconcile_periodically(self) -> None:
        """What the watch missed (a reconnect, a gap), and dataplanes that died on their own."""
        while True:
            await asyncio.sleep(RECONCILE_SECONDS)
            try:
                await self._reconcile_all()
            except (NodusError, NatsError, OSError, TimeoutError) as error:
                log.warning("reconcile pass failed, next in %.0f s: %s", RECONCILE_SECONDS, error)

    async def _reconcile_all(self) -> None:
        """Read the bus's join keys afresh, then reconcile every epoch known either side."""
        read_at = asyncio.get_running_loop().time()
        snapshot = await self.joinkeys.snapshot(f"{self.node}.>")
        for key in set(self.grants) | set(snapshot):
            if self._granted_at.get(key, 0.0) > read_at:
                continue  # the watch said so after this read began: it knows better
            if key in snapshot:
                self.grants[key] = snapshot[key].value
            elif (
                key in self.local
                and (kept := await key_itself(self.joinkeys, key, self.grants)) is not None
            ):
                self.grants[key] = kept
            else:
                self.grants.pop(key, None)
        for key in sorted(set(self.grants) | set(self.local)):
            local = self.local.get(key)
            if local is not None and key not in self.grants and local.since > read_at:
                continue  # joined after the read began: its key is newer than the snapshot
            await self._reconcile(key)

    async def _reconcile(self, key: str) -> None:
        async with self._lock:
            grant = self.grants.get(key)
            local = self.local.get(key)
            live = grant is not None and not (grant.epoch is not None and grant.epoch.fenced)
            if not live:
                if local is not None:
                    await self._leave(key, local)
                elif key in self.failing:  # a refused key, gone: nothing left to say
                    self._refused.pop(key, None)
                    await self.heartbeat.report_failing(key, None)
            elif local is None:
                assert grant is not None
                if self._refused.get(key) != grant.token:
                    await self._join_grant(key, grant)
            else:
                await self._keep(key, local)
            JOINED.labels(self.node).set(len(self.membership.joined))

    async def _join_grant(self, key: str, grant: JoinKeyGrant) -> None:
        try:
            await self._join(grant, key)
        except NodusError as error:
            self._refused[key] = grant.token
            JOINS.labels(self.node, error.code.value).inc()
            if error.code is ErrorCode.CONFLICT and self.store is not None:
                log.warning(
                    "join refused: %s (redeemed by this node before, and nothing of it is on "
                    "this machine's disk: it cannot be re-adopted)",
                    error,
                )
            else:
                log.warning("join refused: %s", error)
            await self.heartbeat.report_failing(key, f"join of {key} refused: {error}")
            return
        local = self.local[key]
        JOINS.labels(self.node, "joined").inc()
        log.info("joined %s epoch %d as rank %d", local.gang, local.epoch, local.state.joined.rank)
        self.epochs.start(key, local, "started")

    async def _keep(self, key: str, local: LocalEpoch) -> None:
        """A live epoch that runs here: its records made sure of once after adoption, its
        dataplane started again if it is not running (same key, with a growing pause)."""
        if local.adopted:
            local.adopted = False
            try:
                await self.membership.register(
                    local.state.epoch, local.wg_private, local.state.joined_time, again=True
                )
            except NodusError as error:
                log.warning("%s epoch %d: %s", local.gang, local.epoch, error)
        if local.state.dataplane is None or local.starting is not None:
            return
        if local.dataplane is not None and local.dataplane.running():
            return
        loop = asyncio.get_running_loop()
        if loop.time() < local.retry_at:
            return
        outcome = "started"
        if local.dataplane is not None and not await self._still_granted(key):
            return  # it ended because its key is gone: the watch is about to say so
        if local.dataplane is not None or local.failures:
            log.warning(
                "%s epoch %d: the dataplane is not running; starting it again",
                local.gang,
                local.epoch,
            )
            local.dataplane = None
            outcome = "restarted"
        if local.state.dataplane.kind == "relayed":
            try:
                await self._rekey(key, local)
            except NodusError as error:
                log.warning("%s epoch %d: %s", local.gang, local.epoch, error)
                return
        self.epochs.start(key, local, outcome)

    async def _rekey(self, key: str, local: LocalEpoch) -> None:
        """A Relayed dataplane starting again (it died, or ran inside the agent before this
        one) does so under a fresh WireGuard key of this node's: its peers' tunnels kept the
        in-tunnel link's sequence numbers of the process that is gone, and would drop the
        newcomer's messages as duplicates under the old key; under a new one each peer meets
        a new peer with a fresh link. (Direct keeps its key: WireGuard's own handshake
        carries a restarted peer, and no link state lives above it.) The connections that
        ran through the dead process are gone with it either way."""
        private = generate_private_key()
        t = now()
        state = msgspec.structs.replace(local.state, joined_time=t)
        if self.store is not None:
            await asyncio.to_thread(self.store.save, state, private)
        local.state, local.wg_private = state, private
        await self.membership.register(state.epoch, private, t, again=True)
        log.info("%s epoch %d: a fresh WireGuard key for its tunnel", local.gang, local.epoch)

    async def _still_granted(self, key: str) -> bool:
        try:
            grant = await self.joinkeys.get(key)
        except (NodusError, NatsError, OSError, TimeoutError):
            return True  # the bus is away: the next pass knows better
        if grant is None:
            self.grants.pop(key, None)
            self._granted_at[key] = asyncio.get_running_loop().time()
            await self._leave(key, self.local[key])
            return False
        return True

    async def _leave(self, key: str, local: LocalEpoch) -> None:
        """The epoch is fenced or ended (its key deleted), maybe while no agent ran: its ranks,
        dataplane and port rules stop, and nothing of it stays (G9)."""
        await self.gangs.stop_epoch(local.gang, local.epoch)
        await self.membership.forget_introductions(local.gang, local.epoch)
        await self.epochs.stop(local)
        self.local.pop(key, None)
        self.membership.forget(key, local.gang, local.epoch)
        self._refused.pop(key, None)
        if self.store is not None:
            self.store.remove(key)
        log.info("left %s epoch %d", local.gang, local.epoch)
        await self.heartbeat.report_failing(key, None)

    # -- what is on disk ---------------------------------------------------------------------

    async def _read_back(self) -> None:
        """The epochs the agent before this one joined, as the machine's disk kept them. Same
        boot: adopted (their key's liveness is the reconcile's to check). Another boot (a
        reboot): their processes are killed and they are forgotten; the placer ends them."""
        if self.store is None:
            return
        for stored in self.store.load_all():
            key = stored.state.key
            process = stored.process
            if process is not None and process.boot_id != self.boot_id:
                if kill_stale(process):
                    DATAPLANES.labels(self.node, "killed").inc()
                await self._end_other_boot(stored)
                self.store.remove(key)
                log.info(
                    "%s epoch %d: of another boot (%s): stopped, not adopted",
                    stored.state.joined.gang,
                    stored.state.joined.epoch,
                    process.boot_id,
                )
                continue
            self._adopt(stored)

    async def _end_other_boot(self, stored: Stored) -> None:
        """A lab reboot leaves the kernel (and its port rules) in place: remove them."""
        epoch = stored.state.epoch
        if epoch.path is PathClass.PRIVATE and self.port_rules and self.boot.simulated:
            await PrivateMember(self.epochs.port_rules(epoch)).stop()

    def _adopt(self, stored: Stored) -> None:
        state = stored.state
        local = LocalEpoch(
            state, stored.wg_private, asyncio.get_running_loop().time(), adopted=True
        )
        self.local[state.key] = local
        self.membership.remember(state.key, state.epoch, state.joined)
        self.membership.guard.advance(state.joined.gang, state.joined.epoch)
        if state.dataplane is not None and stored.process is not None:
            if self.launch is not None and self.store is not None:
                local.dataplane = ProcessDataplane.adopt(self.store, state.key, stored.process)
            if local.dataplane is not None:
                DATAPLANES.labels(self.node, "adopted").inc()
            elif kill_stale(stored.process):  # this agent runs dataplanes in its own process
                log.info("%s: its dataplane process stopped; it runs here now", state.key)
        if state.epoch.path is PathClass.PRIVATE and self.port_rules:
            local.private = PrivateMember(self.epochs.port_rules(state.epoch))
            self.epochs.spawn(local.private.adopt(), name=f"port rules {state.key}")
        log.info("%s epoch %d: adopted from disk", state.joined.gang, state.joined.epoch)

    # -- joining and dataplanes --------------------------------------------------------------

    async def _join(self, grant: JoinKeyGrant, key: str | None = None) -> None:
        """Verify the key against the persisted epoch, use it once, and keep what the next
        agent needs on disk before the key is announced: an agent killed at any point after
        finds the epoch there (or never redeemed it)."""
        epoch, member, t = await self.membership.redeem(grant)
        key = key or names.joinkey_key(self.node, epoch.gang, epoch.epoch)
        private = generate_private_key()
        joined = JoinedEpoch(
            gang=epoch.gang, epoch=epoch.epoch, rank=member.rank, address=member.address
        )
        state = EpochState(
            key=key,
            epoch=epoch,
            joined=joined,
            joined_time=t,
            dataplane=self.epochs.spec(epoch),
        )
        if self.store is not None:
            await asyncio.to_thread(self.store.save, state, private)
        local = LocalEpoch(state, private, asyncio.get_running_loop().time())
        # The probe and the launch ask for it as soon as the member record below is seen.
        self.local[key] = local
        self.membership.remember(key, epoch, joined)
        try:
            await self.membership.register(epoch, private, t)
        except BaseException:
            self.local.pop(key, None)
            self.membership.forget(key, epoch.gang, epoch.epoch)
            if self.store is not None:
                self.store.remove(key)
            raise
        self.membership.guard.advance(epoch.gang, epoch.epoch)


async def key_itself(
    joinkeys: Bucket[JoinKeyGrant], key: str, held: dict[str, JoinKeyGrant]
) -> JoinKeyGrant | None:
    """An epoch that runs here is left only on its key's own word: a read of the whole
    bucket during a server's failover came back without it, and the agent left a running
    gang whose key was there (chaos seed 789536: its rank killed, its job Failed). A key that
    cannot be read is kept as `held` has it; the next pass reads it again."""
    try:
        kept = await joinkeys.get(key)
    except (NodusError, NatsError, OSError, TimeoutError) as error:
        log.warning("%s not read (%s): kept until its key's own word", key, error)
        return held.get(key)
    return kept.value if kept is not None else None

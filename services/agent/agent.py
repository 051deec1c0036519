"""The per-machine agent: registers inventory, version and capabilities (T1, C6), heartbeats,
answers requests addressed to its node (C1), and joins the epochs its join keys name (G9)."""

from __future__ import annotations

import asyncio
import logging
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path

import msgspec
from nats.errors import Error as NatsError
from prometheus_client import Counter, Gauge

from libs.bus import Bus, Endpoint, EpochGuard
from libs.contracts import names
from libs.contracts.api import NodeInfoReply, NodeInfoRequest
from libs.contracts.base import now
from libs.contracts.bounds import HEARTBEAT_TIMEOUT_SECONDS, HEARTBEATS_PER_TIMEOUT
from libs.contracts.epochs import Epoch, EpochMember, JoinKeyGrant, JoinRedemption
from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.fleet import Machine, NodeHealth, NodeRecord, WireGuardInfo
from libs.contracts.jobs import PathClass
from libs.contracts.lifecycle import JoinedEpoch, JoinedEpochsReply, JoinedEpochsRequest
from libs.contracts.relay import Member
from libs.contracts.remediation import RebootReply, RebootRequest
from libs.mesh import verify_join_key
from libs.runtime.tasks import TaskSet, cancel_and_wait
from libs.runtime.version import VERSION as AGENT_VERSION
from libs.wg import generate_private_key, key_to_base64, public_key
from services.agent.direct import DirectMember
from services.agent.gangwork import GangWork
from services.agent.inventory import Described, capabilities_of, inventory_of
from services.agent.member import RelayedMember
from services.agent.private import PortRules, PrivateMember, ephemeral_range
from services.agent.wireguard import for_agent

log = logging.getLogger("nodus.agent")

HEARTBEATS = Counter("nodus_agent_heartbeats_total", "Heartbeats sent", ["node"])
JOINS = Counter(
    "nodus_agent_epoch_joins_total", "Join keys handled by outcome", ["node", "outcome"]
)
DATAPLANES = Counter(
    "nodus_agent_dataplanes_total", "Relayed dataplanes started", ["node", "outcome"]
)
JOINED = Gauge("nodus_agent_joined_epochs", "Epochs this node is a member of", ["node"])


class Agent:
    def __init__(
        self,
        bus: Bus,
        machine: Machine | Described,
        heartbeat_seconds: float = HEARTBEAT_TIMEOUT_SECONDS / HEARTBEATS_PER_TIMEOUT,
        socks_endpoint: str = "",
        tunnel_buffer_limit_bytes: int = 64 << 20,
        state_dir: Path | None = None,
        nodus0: bool = False,
        port_rules: bool = False,
        restart: Callable[[], None] | None = None,
    ) -> None:
        self.bus = bus
        # How a reboot request boots this machine: the daemon starts again (a new process, a
        # new boot id; ranks and tunnels gone). Without one (in-process agents of the tests)
        # only the boot id changes.
        self.restart = restart
        if isinstance(machine, Machine):  # a machine of the fleet file (the lab)
            self.inventory, self.capabilities = inventory_of(machine), capabilities_of(machine)
        else:  # a machine that described itself (O1)
            self.inventory, self.capabilities = machine.inventory, machine.capabilities
        self.node = self.inventory.node
        self.heartbeat_seconds = heartbeat_seconds
        # Direct epochs get a nodus0 here: a VM's agent with its own network namespace (a
        # machine, or a machine of the lab); agents that share one namespace cannot.
        self.nodus0 = nodus0 and self.inventory.offering == "vm"
        self.port_rules = port_rules  # on a private network: its rules are this agent's (G22)
        self.wireguard: WireGuardInfo | None = None  # what nodus0 runs (O5), chosen at start
        self.boot_id = str(uuid.uuid4())  # a simulated machine boots when its agent starts
        self.socks_endpoint = socks_endpoint or "127.0.0.1:1080"
        self.tunnel_buffer_limit_bytes = tunnel_buffer_limit_bytes
        self.nodes = bus.bucket(names.BUCKET_NODES, NodeRecord)
        self.health = bus.bucket(names.BUCKET_HEALTH, NodeHealth)
        self.epoch_records: dict[tuple[str, int], Epoch] = {}  # as the join keys brought them
        self.peers = bus.bucket(names.BUCKET_PEERS, Member)
        self.joinkeys = bus.bucket(names.BUCKET_JOINKEYS, JoinKeyGrant)
        self.redeemed = bus.bucket(names.BUCKET_REDEEMED, JoinRedemption)
        self.joined: dict[str, JoinedEpoch] = {}  # joinkey key -> membership
        self.guard = EpochGuard()  # the newest epoch joined per gang (C2)
        self.members = bus.bucket(names.BUCKET_MEMBERS, Member)
        self.relayed: dict[str, RelayedMember] = {}  # joinkey key -> the Relayed dataplane
        self.direct: dict[str, DirectMember] = {}  # joinkey key -> the Direct dataplane
        self.private: dict[str, PrivateMember] = {}  # joinkey key -> its private port rules
        self._wg_keys: dict[str, bytes] = {}  # "gang.epoch" -> this node's WireGuard key
        self._starting = TaskSet("agent dataplane start", log)
        self._start_tasks: dict[str, asyncio.Task[None]] = {}  # joinkey key -> its start
        self._tasks: list[asyncio.Task[None]] = []
        state = state_dir or Path(tempfile.gettempdir()) / "nodus" / self.node
        self.gangs = GangWork(
            bus,
            self.node,
            state / "logs",
            self._path_of,
            self._joined_epoch,
            scratch_dir=state / "scratch" if state_dir else None,
        )

    async def _path_of(self, gang: str, epoch: int, peer: str) -> str | None:
        """The path to `peer` the workload's bytes take now: the tunnel's relay on the
        Relayed path; on the Direct path, once the pair's first checks ended, `direct` or
        the relay that carries it."""
        for runtime in self.relayed.values():
            if (runtime.epoch.gang, runtime.epoch.epoch) == (gang, epoch) and runtime.tunnel:
                return runtime.tunnel.path
        for direct in self.direct.values():
            if (direct.epoch.gang, direct.epoch.epoch) == (gang, epoch):
                await direct.first_round(peer)
                return direct.path_to(peer)
        return None

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
        await self.bus.serve(
            "nodus-agent",
            AGENT_VERSION,
            f"Agent of machine {self.node}",
            [
                Endpoint("info", names.node_request(self.node, "info"), NodeInfoRequest, self.info),
                Endpoint(
                    "epochs",
                    names.node_request(self.node, "epochs"),
                    JoinedEpochsRequest,
                    self.epochs_joined,
                ),
                *self.gangs.endpoints(),
                Endpoint(
                    "reboot", names.node_request(self.node, "reboot"), RebootRequest, self.reboot
                ),
            ],
        )
        await self.gangs.runner.stop_previous_boot()
        if self.nodus0:
            self.wireguard = await for_agent(self.node)
        await self.nodes.put(self.node, self.record())
        await self._beat()
        self._tasks = [
            asyncio.create_task(self._heartbeats()),
            asyncio.create_task(self._join_epochs()),
        ]
        log.info("agent %s registered (boot %s)", self.node, self.boot_id)

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)
        await self._starting.close()
        await self.gangs.close()
        dataplanes: list[RelayedMember | DirectMember | PrivateMember] = [
            *self.relayed.values(),
            *self.direct.values(),
            *self.private.values(),
        ]
        for runtime in dataplanes:
            await runtime.stop()
        self.relayed.clear()
        self.direct.clear()
        self.private.clear()

    async def reboot(self, _: RebootRequest) -> RebootReply:
        """The lab's machine boots again: the agent restarts, and registers with a new boot id
        (the answer goes first, so the provider knows the boot began)."""
        if self.restart is not None:
            log.info("agent %s reboots: its ranks and tunnels stop, it starts again", self.node)
            asyncio.get_running_loop().call_later(0.05, self.restart)
            return RebootReply(node=self.node, boot_id="")
        self.boot_id = str(uuid.uuid4())
        await self.nodes.put(self.node, self.record())
        await self._beat()
        return RebootReply(node=self.node, boot_id=self.boot_id)

    async def info(self, _: NodeInfoRequest) -> NodeInfoReply:
        return NodeInfoReply(node=self.record())

    async def epochs_joined(self, _: JoinedEpochsRequest) -> JoinedEpochsReply:
        epochs = []
        for key, joined in self.joined.items():
            runtime = self.relayed.get(key)
            tunnel = runtime.tunnel if runtime is not None and runtime.socks is not None else None
            if tunnel is not None and tunnel.home is not None:
                joined = msgspec.structs.replace(joined, path=tunnel.path, relay=tunnel.home.name)
            epochs.append(joined)
        return JoinedEpochsReply(node=self.node, epochs=epochs)

    async def _beat(self) -> None:
        await self.health.put(
            self.node,
            NodeHealth(node=self.node, healthy=True, heartbeat_time=now(), boot_id=self.boot_id),
        )
        HEARTBEATS.labels(self.node).inc()

    async def _heartbeats(self) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_seconds)
            try:
                await self._beat()
            except Exception as error:  # the bus reconnects; keep beating
                log.warning("heartbeat failed: %s", error)

    async def _join_epochs(self) -> None:
        async for change in self.joinkeys.watch(f"{self.node}.>"):
            if change.value is None:
                starting = self._start_tasks.pop(change.key, None)
                if starting is not None and not starting.done():
                    starting.cancel()  # the epoch ended while its dataplane started
                left = self.joined.pop(change.key, None)
                if left is not None:  # the epoch is fenced or deleted: its ranks stop (G9)
                    await self.gangs.stop_epoch(left.gang, left.epoch)
                    await self._forget_introductions(left.gang, left.epoch)
                    self.epoch_records.pop((left.gang, left.epoch), None)
                gone: list[RelayedMember | DirectMember | PrivateMember | None] = [
                    self.relayed.pop(change.key, None),
                    self.direct.pop(change.key, None),
                    self.private.pop(change.key, None),
                ]
                for runtime in gone:
                    if runtime is not None:
                        await runtime.stop()
                if left:
                    log.info("left %s epoch %d", left.gang, left.epoch)
            else:
                try:
                    joined = await self._join(change.value)
                    self.joined[change.key] = joined
                    self._start_tasks[change.key] = self._starting.spawn(
                        self._start_dataplane(change.key, joined),
                        name=f"dataplane {joined.gang} epoch {joined.epoch}",
                    )
                    JOINS.labels(self.node, "joined").inc()
                    log.info(
                        "joined %s epoch %d as rank %d", joined.gang, joined.epoch, joined.rank
                    )
                except NodusError as error:
                    JOINS.labels(self.node, error.code.value).inc()
                    log.warning("join refused: %s", error)
            JOINED.labels(self.node).set(len(self.joined))

    async def _introduce(self, epoch: Epoch, record: Member) -> None:
        """This member's record for each peer, addressed to it: peers read only what is
        addressed to them (S1)."""
        try:
            await asyncio.gather(
                *(
                    self.peers.put(
                        names.peer_key(epoch.gang, epoch.epoch, m.node, self.node), record
                    )
                    for m in epoch.members
                    if m.node != self.node
                )
            )
        except (NatsError, OSError, TimeoutError) as error:
            raise NodusError(
                ErrorCode.JOURNAL_UNAVAILABLE,
                f"{epoch.gang} epoch {epoch.epoch}: cannot introduce {self.node} to its "
                f"peers: {error!r}",
            ) from None

    async def _forget_introductions(self, gang: str, epoch: int) -> None:
        record = self.epoch_records.get((gang, epoch))
        if record is None:
            return
        for m in record.members:
            if m.node != self.node:
                try:
                    await self.peers.delete(names.peer_key(gang, epoch, m.node, self.node))
                except (NodusError, NatsError, OSError, TimeoutError) as error:
                    log.info("%s epoch %d: its introductions stay: %s", gang, epoch, error)
                    return

    async def _register_member(self, epoch: Epoch, member: EpochMember) -> bytes:
        """A fresh WireGuard key per epoch, bound to this node once (relays admit only it,
        S2), recorded and introduced to the peers; the private half."""
        private = generate_private_key()
        record = Member(
            gang=epoch.gang,
            epoch=epoch.epoch,
            node=self.node,
            rank=member.rank,
            address=member.address,
            wg_public_key=key_to_base64(public_key(private)),
            joined_time=now(),
        )
        key = names.member_key(epoch.gang, epoch.epoch, self.node)
        if await self.members.create(key, record) is None:
            raise NodusError(
                ErrorCode.CONFLICT,
                f"{self.node} already holds a key in {epoch.gang} epoch {epoch.epoch}",
            )
        await self._introduce(epoch, record)
        return private

    def _joined_epoch(self, gang: str, epoch: int) -> Epoch:
        """An epoch this node holds a key of, as the key brought it. One it left (its key was
        deleted: fenced) or that a newer one replaced is stale (the guard remembers)."""
        record = self.epoch_records.get((gang, epoch))
        current = self.guard.current(gang)
        if current is not None and (epoch < current or (record is None and epoch == current)):
            raise NodusError(ErrorCode.STALE_EPOCH, f"{gang} epoch {epoch} is fenced")
        if record is None:
            raise NodusError(
                ErrorCode.EPOCH_MISMATCH, f"{self.node} holds no join key of {gang} epoch {epoch}"
            )
        return record

    async def _start_dataplane(self, key: str, joined: JoinedEpoch) -> None:
        """One epoch's dataplane. One that cannot start is this epoch's failure, not the
        agent's: said, and left to the probe, which fails the epoch (G12)."""
        try:
            await self._start_epoch_dataplane(key, joined)
        except (NodusError, OSError, TimeoutError) as error:
            log.warning(
                "%s epoch %d: the dataplane did not start: %s", joined.gang, joined.epoch, error
            )
        finally:
            self._start_tasks.pop(key, None)

    async def _start_epoch_dataplane(self, key: str, joined: JoinedEpoch) -> None:
        """On the Relayed path: the tunnel through the relays and the SOCKS5 entry (G14); on
        the Direct path: nodus0 and ICE with every peer (G7, G11); on the Private path: the
        port rules on the private network (G22)."""
        epoch_record = self.epoch_records.get((joined.gang, joined.epoch))
        if epoch_record is None:
            return
        member = next(m for m in epoch_record.members if m.node == self.node)
        wg_private = self._wg_keys[f"{joined.gang}.{joined.epoch}"]
        if epoch_record.path is PathClass.DIRECT and self.nodus0:
            direct = DirectMember(
                self.bus, epoch_record, member, wg_private, underlay=self.inventory.address
            )
            self.direct[key] = direct  # the probe may ask for its paths while it starts
            try:
                await direct.start()
            except Exception:
                self.direct.pop(key, None)
                await direct.stop()
                raise
            return
        if epoch_record.path is PathClass.PRIVATE and self.port_rules:
            private = PrivateMember(
                PortRules(
                    gang=joined.gang,
                    epoch=joined.epoch,
                    interface=member.interface,
                    members=tuple(m.address for m in epoch_record.members if m.node != self.node),
                    rendezvous_port=int(member.env.get("MASTER_PORT", "29500")),
                    ephemeral=ephemeral_range(),
                )
            )
            await private.start()
            self.private[key] = private
            return
        if epoch_record.path is not PathClass.RELAYED:
            return
        host, _, port = self.socks_endpoint.rpartition(":")
        runtime = RelayedMember(
            self.bus,
            epoch_record,
            member,
            wg_private,
            (host, int(port)),
        )
        try:
            await runtime.start()
        except Exception:
            await runtime.stop()
            raise
        self.relayed[key] = runtime

    async def _join(self, grant: JoinKeyGrant) -> JoinedEpoch:
        """Verify the key against the persisted epoch, then use it once."""
        t = now()
        claims = verify_join_key(grant.token, grant.verify_key, t)
        current = self.guard.current(claims.gang)
        if current is not None and claims.epoch < current:
            raise NodusError(
                ErrorCode.STALE_EPOCH,
                f"{claims.gang}: join key for epoch {claims.epoch}, this node is on epoch {current}",
            )
        if claims.node != self.node:
            raise NodusError(
                ErrorCode.INVALID, f"join key names node {claims.node}, not {self.node}"
            )
        epoch = grant.epoch
        if epoch is None or (epoch.gang, epoch.epoch) != (claims.gang, claims.epoch):
            raise NodusError(
                ErrorCode.EPOCH_MISMATCH,
                f"the grant of {claims.gang} epoch {claims.epoch} brings no such epoch",
            )
        if epoch.fenced:
            raise NodusError(ErrorCode.STALE_EPOCH, f"{claims.gang} epoch {claims.epoch} is fenced")
        if epoch.verify_key != grant.verify_key or epoch.mesh_id != claims.mesh_id:
            raise NodusError(
                ErrorCode.INVALID, "join key was not signed by the epoch's mesh identity"
            )
        member = next((m for m in epoch.members if m.node == self.node), None)
        if member is None:
            raise NodusError(ErrorCode.INVALID, f"{self.node} is not a member of {claims.gang}")
        redemption = JoinRedemption(
            gang=claims.gang, epoch=claims.epoch, node=self.node, redeemed_time=t
        )
        if (
            await self.redeemed.create(names.redeemed_key(self.node, claims.nonce), redemption)
            is None
        ):
            raise NodusError(
                ErrorCode.CONFLICT,
                f"join key for {claims.gang} epoch {claims.epoch} was already used",
            )
        # The probe and the launch ask for it as soon as the member record below is seen.
        self.epoch_records[(claims.gang, claims.epoch)] = epoch
        try:
            private = await self._register_member(epoch, member)
        except BaseException:
            self.epoch_records.pop((claims.gang, claims.epoch), None)
            raise
        self._wg_keys[f"{claims.gang}.{claims.epoch}"] = private
        self.guard.advance(claims.gang, claims.epoch)
        return JoinedEpoch(
            gang=claims.gang, epoch=claims.epoch, rank=member.rank, address=member.address
        )

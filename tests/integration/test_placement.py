"""Placement through the real placer on a real nats-server: one gang per path class with every
G8 variable, epochs persisted before their join keys, ranktables, IP collisions, deletion."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from libs.bus import Bus
from libs.client.client import Client
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.epochs import AddressClaim, Epoch, JoinKeyGrant, Lease, Ranktable
from libs.contracts.jobs import ConditionType, Job, Phase
from libs.mesh import verify_join_key
from services.placer.addresses import MESH_NETWORK
from tests.conftest import StartPlacer, eventually, placed
from tests.factories import job, machine, node_record, register

SHIM = "/opt/nodus/lib/libnodus-netshim.so"
L4 = {"count": 1, "backend": "cuda", "model": "L4"}
FLEET = [
    # One VPC in aws us-east-1: Private.
    machine(
        "aws-a",
        address="10.0.0.1",
        privateNetwork="vpc",
        privateAddress="172.16.0.1",
        privateInterface="ens5",
    ),
    machine(
        "aws-b",
        address="10.0.0.2",
        privateNetwork="vpc",
        privateAddress="172.16.0.2",
        privateInterface="ens5",
    ),
    # ROCm VMs in two providers, no shared private network: Direct.
    machine(
        "lam-a",
        provider="lambda",
        region="us-west-1",
        address="10.0.1.1",
        accelerators={"count": 8, "backend": "rocm", "model": "MI300X"},
    ),
    machine(
        "gcp-a",
        provider="gcp",
        region="europe-west4",
        regionClass="eu",
        address="10.0.2.1",
        accelerators={"count": 8, "backend": "rocm", "model": "MI300X"},
    ),
    # An L4 container and an L4 VM: Relayed.
    machine(
        "vast-a",
        provider="vast",
        offering="container",
        address="10.0.3.1",
        accelerators=L4,
    ),
    machine(
        "lam-l4",
        provider="lambda",
        region="us-west-1",
        address="10.0.1.9",
        accelerators=L4,
    ),
]

PRIVATE = job(
    "llama",
    org="acme",
    env={"NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "bogus"},
    accelerators={"model": "H100"},
    distributed={"members": 2, "network": "Colocated"},
)
DIRECT = job("mixtral", org="globex", accelerators={"backend": "rocm"}, distributed={"members": 2})
RELAYED = job(
    "rl",
    org="initech",
    image={"env": {"LD_PRELOAD": "/usr/lib/libjemalloc.so"}},
    accelerators={"model": "L4"},
    distributed={"members": 2, "transport": "Auto"},
)


@pytest.fixture
async def placed_gangs(bus: Bus, start_placer: StartPlacer) -> dict[str, Job]:
    await register(bus, [node_record(m) for m in FLEET])
    await start_placer()
    client = Client(bus)
    for submitted in (PRIVATE, DIRECT, RELAYED):
        await client.apply(submitted)
    return {j.metadata.name: await placed(bus, j.key) for j in (PRIVATE, DIRECT, RELAYED)}


async def test_each_path_class_is_chosen_from_the_inventory(placed_gangs: dict[str, Job]) -> None:
    transports = {
        name: j.status.gang.transport.value for name, j in placed_gangs.items() if j.status.gang
    }
    assert transports == {"llama": "private", "mixtral": "direct", "rl": "relayed"}
    for placed_job in placed_gangs.values():
        assert placed_job.status.epoch == 1
        ready = placed_job.condition(ConditionType.GANG_READY)
        assert ready is not None and ready.status == "True"
    relayed = placed_gangs["rl"].status.gang
    assert relayed is not None and relayed.estimate is not None
    assert relayed.estimate.relative_to_direct == 0.25  # G19
    assert relayed.estimate.warning and "4x slower" in relayed.estimate.warning
    direct = placed_gangs["mixtral"].status.gang
    assert direct is not None and direct.estimate is not None and direct.estimate.warning is None


async def test_every_rank_gets_the_g8_environment_on_every_path(
    bus: Bus, placed_gangs: dict[str, Job]
) -> None:
    client = Client(bus)
    envs = {name: [await client.rank_env(name, rank) for rank in range(2)] for name in placed_gangs}
    common = [
        "NODUS_GANG_TRANSPORT",
        "MASTER_ADDR",
        "MASTER_PORT",
        "PET_RDZV_ENDPOINT",
        "PET_NNODES",
        "PET_NODE_RANK",
        "NODE_RANK",
        "WORLD_SIZE",
        "NODUS_NODE_IPS",
        "NCCL_SOCKET_IFNAME",
        "GLOO_SOCKET_IFNAME",
    ]
    for name, ranks in envs.items():
        for rank, env in enumerate(ranks):
            missing = [key for key in common if key not in env]
            assert not missing, f"{name} rank {rank} lacks {missing}"
            assert env["PET_NODE_RANK"] == env["NODE_RANK"] == str(rank)
            assert env["PET_NNODES"] == env["WORLD_SIZE"] == "2"
            assert env["MASTER_ADDR"] == env["NODUS_NODE_IPS"].split(",")[0]
            assert env["PET_RDZV_ENDPOINT"] == f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
            assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"]
            assert env["NCCL_NET"] == "Socket" and env["NCCL_IB_DISABLE"] == "1"

    private = envs["llama"]
    assert {e["NODUS_GANG_TRANSPORT"] for e in private} == {"private"}
    assert private[0]["NODUS_NODE_IPS"] == "172.16.0.1,172.16.0.2"  # private IPs (G7)
    assert private[1]["NCCL_SOCKET_IFNAME"] == "ens5"  # the path wins over the user's value
    assert private[1]["NCCL_DEBUG"] == "INFO"  # the user's other NCCL_* win
    assert all("LD_PRELOAD" not in e and "NODUS_NETSHIM_PEERS" not in e for e in private)

    direct = envs["mixtral"]
    assert {e["NODUS_GANG_TRANSPORT"] for e in direct} == {"direct"}
    mesh = direct[0]["NODUS_NODE_IPS"].split(",")
    assert len(set(mesh)) == 2
    assert all(__import__("ipaddress").ip_address(a) in MESH_NETWORK for a in mesh)
    assert {e["NCCL_SOCKET_IFNAME"] for e in direct} == {"nodus0"}
    assert direct[0]["NODUS_COLLECTIVES"] == "rccl" and direct[0]["HIP_VISIBLE_DEVICES"].startswith(
        "0,"
    )
    assert direct[0]["NODUS_DEVICES"].startswith("ROCm0,")  # C5

    relayed = envs["rl"]
    assert {e["NODUS_GANG_TRANSPORT"] for e in relayed} == {"relayed"}
    assert relayed[0]["NODUS_NODE_IPS"] == "10.0.1.9,10.0.3.1"  # the members' own eth0 (G7)
    assert {e["NCCL_SOCKET_IFNAME"] for e in relayed} == {"eth0"}
    for env in relayed:
        assert env["LD_PRELOAD"].split(":") == [SHIM, "/usr/lib/libjemalloc.so"]  # shim first
        own = env["NODUS_NODE_IPS"].split(",")[int(env["NODE_RANK"])]
        assert env["NODUS_NETSHIM_PEERS"].split(",") == [
            a for a in env["NODUS_NODE_IPS"].split(",") if a != own
        ]
        assert env["NODUS_NETSHIM_SOCKS"] == "127.0.0.1:1080"
    assert relayed[0]["NODUS_DEVICES"] == "CUDA0" and relayed[0]["CUDA_VISIBLE_DEVICES"] == "0"


async def test_epochs_carry_a_fresh_identity_and_join_keys_for_their_members_only(
    bus: Bus, placed_gangs: dict[str, Job]
) -> None:
    epochs = bus.bucket(names.BUCKET_EPOCHS, Epoch)
    grants = bus.bucket(names.BUCKET_JOINKEYS, JoinKeyGrant)
    seen_mesh_ids = set()
    for placed_job in placed_gangs.values():
        stored = await epochs.get(names.epoch_key(placed_job.key, 1))
        assert stored is not None
        epoch = stored.value
        seen_mesh_ids.add(epoch.mesh_id)
        expires = epoch.join_keys_expire_time - epoch.created_time
        assert timedelta(minutes=14, seconds=59) < expires <= timedelta(minutes=15)
        nonces = set()
        for member in epoch.members:
            grant = await grants.get(names.joinkey_key(member.node, placed_job.key, 1))
            assert grant is not None
            claims = verify_join_key(grant.value.token, epoch.verify_key, now())
            assert (claims.gang, claims.epoch, claims.mesh_id) == (
                placed_job.key,
                1,
                epoch.mesh_id,
            )
            assert set(claims.nonces) == {m.node for m in epoch.members}
            nonces.add(claims.nonce_of(member.node))
        assert len(nonces) == len(epoch.members), "each member redeems a nonce of its own"
    assert len(seen_mesh_ids) == 3
    # A key checked against another epoch's identity is refused.
    other = await epochs.get(names.epoch_key(placed_gangs["rl"].key, 1))
    grant = await grants.get(names.joinkey_key("aws-a", placed_gangs["llama"].key, 1))
    assert other is not None and grant is not None
    with pytest.raises(Exception, match="join key rejected"):
        verify_join_key(grant.value.token, other.value.verify_key, now())


async def test_the_epoch_is_persisted_before_any_join_key_names_it(
    bus: Bus, start_placer: StartPlacer
) -> None:
    await register(bus, [node_record(m) for m in FLEET])
    await start_placer()
    epochs = bus.bucket(names.BUCKET_EPOCHS, Epoch)
    grants = bus.bucket(names.BUCKET_JOINKEYS, JoinKeyGrant)
    checked: list[bool] = []

    async def watch_grants() -> None:
        async for change in grants.watch():
            if change.value is not None:
                _node, org, name, epoch = change.key.split(".")
                checked.append(
                    await epochs.get(names.epoch_key(f"{org}.{name}", int(epoch))) is not None
                )

    watcher = asyncio.create_task(watch_grants())
    try:
        client = Client(bus)
        for submitted in (PRIVATE, DIRECT, RELAYED):
            await client.apply(submitted)
        for submitted in (PRIVATE, DIRECT, RELAYED):
            await placed(bus, submitted.key)

        async def all_seen() -> bool:
            return len(checked) == 6

        await eventually(all_seen)
        assert all(checked)
    finally:
        watcher.cancel()


async def test_a_gang_with_an_older_agent_gets_a_one_member_key_each(
    bus: Bus, start_placer: StartPlacer
) -> None:
    """An agent that does not say it reads a key naming every member (an older one, mid
    upgrade) is given a key that names it alone; its gang's other members too."""
    older = ["register", "heartbeat", "join-epoch"]
    await register(
        bus, [node_record(m, capabilities=older if m.name == "aws-a" else None) for m in FLEET]
    )
    await start_placer()
    await Client(bus).apply(PRIVATE)
    await placed(bus, PRIVATE.key)
    stored = await bus.bucket(names.BUCKET_EPOCHS, Epoch).get(names.epoch_key(PRIVATE.key, 1))
    assert stored is not None
    grants = bus.bucket(names.BUCKET_JOINKEYS, JoinKeyGrant)
    for member in stored.value.members:
        grant = await grants.get(names.joinkey_key(member.node, PRIVATE.key, 1))
        assert grant is not None and grant.value.epoch == stored.value
        claims = verify_join_key(grant.value.token, stored.value.verify_key, now())
        assert (claims.node, claims.nonces) == (member.node, {})
        assert claims.nonce_of(member.node)


async def test_ranktables_per_gang_and_the_global_view_in_order(
    bus: Bus, start_placer: StartPlacer
) -> None:
    await register(bus, [node_record(m) for m in FLEET])
    await start_placer()
    ranktables = bus.bucket(names.BUCKET_RANKTABLES, Ranktable)
    seen: list[tuple[str, int, Ranktable | None]] = []

    async def watch_all() -> None:
        async for change in ranktables.watch():
            seen.append((change.key, change.revision, change.value))

    watcher = asyncio.create_task(watch_all())
    try:
        client = Client(bus)
        for submitted in (PRIVATE, DIRECT, RELAYED):
            await client.apply(submitted)
            await placed(bus, submitted.key)
        await client.delete("mixtral")

        async def four_changes() -> bool:
            return len(seen) == 4

        await eventually(four_changes)
    finally:
        watcher.cancel()
    assert [key for key, _, _ in seen] == [
        "acme.llama",
        "globex.mixtral",
        "initech.rl",
        "globex.mixtral",
    ]
    revisions = [revision for _, revision, _ in seen]
    assert revisions == sorted(revisions)
    first = seen[0][2]
    assert first is not None and [e.node for e in first.entries] == ["aws-a", "aws-b"]
    assert first.entries[0].address == "172.16.0.1" and first.entries[0].eth0 == "10.0.0.1"
    assert first.entries[0].devices[:2] == ["CUDA0", "CUDA1"]
    assert seen[3][2] is None  # the deleted gang leaves the global ranktable
    now_table = await client.global_ranktable()
    assert set(now_table) == {"acme.llama", "initech.rl"}


async def test_two_running_relayed_gangs_never_route_one_address(
    bus: Bus, start_placer: StartPlacer
) -> None:
    # Four machines but three addresses: two containers in different providers share 10.9.0.5.
    fleet = [
        machine(
            "vast-x", provider="vast", offering="container", address="10.9.0.5", accelerators=L4
        ),
        machine(
            "runpod-x", provider="runpod", offering="container", address="10.9.0.5", accelerators=L4
        ),
        machine(
            "runpod-y", provider="runpod", offering="container", address="10.9.0.7", accelerators=L4
        ),
        machine("vm-1", address="10.0.0.1", accelerators=L4),
    ]
    await register(bus, [node_record(m) for m in fleet])
    await start_placer()
    client = Client(bus)
    spec = {"accelerators": {"model": "L4"}, "distributed": {"members": 2, "transport": "Auto"}}
    await client.apply(job("first", org="acme", **spec))
    first = await placed(bus, "acme.first")
    await client.apply(job("second", org="acme", **spec))
    jobs = bus.bucket(names.BUCKET_JOBS, Job)

    async def held_back() -> bool:
        current = await jobs.get("acme.second")
        ready = current.value.condition(ConditionType.GANG_READY) if current else None
        return ready is not None and ready.status == "False"

    await eventually(held_back)
    second = await jobs.get("acme.second")
    assert second is not None and second.value.status.phase is Phase.PENDING
    # Once the first gang is gone, its addresses are free to route again.
    await client.delete("first")
    now_placed = await placed(bus, "acme.second")
    assert first.status.gang is not None and now_placed.status.gang is not None
    addresses = [m.address for m in now_placed.status.gang.members]
    assert len(set(addresses)) == 2
    claims = await bus.bucket(names.BUCKET_ADDRESSES, AddressClaim).snapshot()
    assert {c.value.gang for c in claims.values()} == {"acme.second"}
    assert {names.address_key(a) for a in addresses} == set(claims)


async def test_ip_collision_condition_is_shown_while_re_placing(
    bus: Bus, start_placer: StartPlacer
) -> None:
    fleet = [
        machine(
            "c-1",
            provider="vast",
            offering="container",
            address="10.9.0.5",
            accelerators=L4,
        ),
        machine(
            "c-2",
            provider="runpod",
            offering="container",
            address="10.9.0.6",
            accelerators=L4,
        ),
    ]
    await register(bus, [node_record(m) for m in fleet])
    # Another placer's running Relayed gang already routes 10.9.0.5 (this one has not seen it).
    await bus.bucket(names.BUCKET_ADDRESSES, AddressClaim).put(
        names.address_key("10.9.0.5"), AddressClaim(gang="other.gang", epoch=1, node="elsewhere")
    )
    await start_placer()
    history: list[Job] = []
    jobs = bus.bucket(names.BUCKET_JOBS, Job)

    async def record() -> None:
        async for change in jobs.watch("acme.clash"):
            if change.value is not None:
                history.append(change.value)

    watcher = asyncio.create_task(record())
    try:
        await Client(bus).apply(
            job(
                "clash",
                org="acme",
                accelerators={"model": "L4"},
                distributed={"members": 2, "transport": "Auto"},
            )
        )

        async def shown() -> bool:
            return any(
                (c := j.condition(ConditionType.GANG_READY)) is not None
                and c.reason == "IPCollision"
                for j in history
            )

        await eventually(shown)
    finally:
        watcher.cancel()
    collision = next(
        c
        for j in history
        if (c := j.condition(ConditionType.GANG_READY)) and c.reason == "IPCollision"
    )
    assert collision.status == "False"
    assert "10.9.0.5" in collision.message and "other.gang" in collision.message
    assert all(j.status.phase is Phase.PENDING for j in history)  # never placed on the clash


async def test_delete_fences_the_epoch_and_frees_machines_for_a_waiting_job(
    bus: Bus, start_placer: StartPlacer
) -> None:
    await register(bus, [node_record(m) for m in FLEET[:2]])
    await start_placer()
    client = Client(bus)
    await client.apply(job("one", org="acme", accelerators={"model": "H100"}))
    first = await placed(bus, "acme.one")
    await client.apply(job("two", org="acme", accelerators={"model": "H100"}))
    jobs = bus.bucket(names.BUCKET_JOBS, Job)

    async def waiting() -> bool:
        current = await jobs.get("acme.two")
        ready = current.value.condition(ConditionType.GANG_READY) if current else None
        return ready is not None and ready.reason == "Unschedulable"

    await eventually(waiting)
    await client.delete("one")
    epoch = await bus.bucket(names.BUCKET_EPOCHS, Epoch).get(names.epoch_key("acme.one", 1))
    assert epoch is not None and epoch.value.fenced  # G9: fenced first
    assert await jobs.get("acme.one") is None
    for member in first.status.gang.members if first.status.gang else []:
        grant = await bus.bucket(names.BUCKET_JOINKEYS, JoinKeyGrant).get(
            names.joinkey_key(member.node, "acme.one", 1)
        )
        assert grant is None
    second = await placed(bus, "acme.two")
    assert second.status.gang is not None
    assert {m.node for m in second.status.gang.members} == {"aws-a", "aws-b"}
    leases = await bus.bucket(names.BUCKET_LEASES, Lease).snapshot()
    assert {lease.value.gang for lease in leases.values()} == {"acme.two"}


async def test_a_torn_down_epoch_frees_its_machines_for_the_next_plan_at_once(
    bus: Bus, start_placer: StartPlacer
) -> None:
    """A gang that lost a member is planned again right after its old epoch is torn down:
    its other machines must be free by then, not when the lease watch says so (they looked
    taken, and the lost member was placed again in their stead: CI, test_e)."""
    await register(bus, [node_record(m) for m in FLEET[:2]])
    placer = await start_placer()
    await Client(bus).apply(job("one", org="acme", accelerators={"model": "H100"}))
    first = await placed(bus, "acme.one")
    assert first.status.gang is not None
    nodes = {m.node for m in first.status.gang.members}
    assert not any(node in placer.view.free for node in nodes)
    # The lease watch would tell the view, later: stopped, so that only the teardown can.
    watching_leases = next(t for t in placer._tasks if "_watch_leases" in repr(t.get_coro()))
    watching_leases.cancel()
    await asyncio.gather(watching_leases, return_exceptions=True)
    await placer.committer.teardown("acme.one", 1)
    assert all(node in placer.view.free for node in nodes)

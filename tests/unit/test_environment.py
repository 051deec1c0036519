"""Each rank's environment (G8) with backend-derived names (C5)."""

from __future__ import annotations

from typing import Any

import pytest

from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.fleet import NodeRecord
from libs.contracts.jobs import Job, PathClass
from services.placer.addresses import mesh_addresses
from services.placer.config import load_config
from services.placer.environment import rank_environments
from services.placer.invariants import check_plan
from services.placer.planner import Plan, Planner
from tests.factories import job, machine, node_record

SHIM = "/opt/nodus/lib/libnodus-netshim.so"
PORT = 29500
EPOCH = 3
MESH_ID = "0000beef" + "0" * 24

G8_COMMON = (
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
)
G8_RELAYED = ("LD_PRELOAD", "NODUS_NETSHIM_PEERS", "NODUS_NETSHIM_SOCKS")

CUDA = {"count": 4, "backend": "cuda", "model": "H100"}
ROCM = {"count": 2, "backend": "rocm", "model": "MI300X"}


def fleet(
    path: PathClass, members: int = 3, accelerators: dict[str, Any] | None = None
) -> list[NodeRecord]:
    acc = accelerators or CUDA
    records = []
    for i in range(members):
        fields: dict[str, Any] = {"address": f"10.0.0.{i + 1}", "accelerators": acc}
        if path is PathClass.PRIVATE:
            fields.update(
                privateNetwork="vpc-a", privateAddress=f"172.16.0.{i + 1}", privateInterface="ens5"
            )
        if path is PathClass.RELAYED:
            fields.update(offering="container")
        records.append(node_record(machine(f"m{i}", **fields)))
    return records


def spec_for(path: PathClass, members: int = 3, **spec: Any) -> Job:
    transport = "Auto" if path is PathClass.RELAYED else "Direct"
    return job(distributed={"members": members, "transport": transport}, **spec)


def planned(
    path: PathClass, members: int = 3, accelerators: dict[str, Any] | None = None, **spec: Any
) -> tuple[Job, Plan, dict[str, NodeRecord]]:
    cfg = load_config()
    cfg.relayed_max_members = 8
    records = fleet(path, members, accelerators)
    the_job = spec_for(path, members, **spec)
    plan, shortfalls = Planner(cfg).plan(the_job, records, mesh_id=MESH_ID)
    assert plan is not None, shortfalls
    assert plan.path is path
    by_node = {r.inventory.node: r for r in records}
    assert check_plan(plan, by_node, the_job) == []
    return the_job, plan, by_node


def envs_for(
    path: PathClass, members: int = 3, accelerators: dict[str, Any] | None = None, **spec: Any
) -> list[dict[str, str]]:
    the_job, plan, records = planned(path, members, accelerators, **spec)
    return rank_environments(the_job, plan, records, EPOCH, PORT, SHIM)


EXPECTED_ADDRESSES = {
    PathClass.PRIVATE: ["172.16.0.1", "172.16.0.2", "172.16.0.3"],
    PathClass.DIRECT: mesh_addresses(MESH_ID, 3),
    PathClass.RELAYED: ["10.0.0.1", "10.0.0.2", "10.0.0.3"],
}
EXPECTED_INTERFACE = {
    PathClass.PRIVATE: "ens5",
    PathClass.DIRECT: "nodus0",
    PathClass.RELAYED: "eth0",
}
ALL_PATHS = [PathClass.PRIVATE, PathClass.DIRECT, PathClass.RELAYED]


# -- G8: every variable, per path class -------------------------------------------------------


@pytest.mark.parametrize("path", ALL_PATHS)
def test_every_g8_variable_is_set_on_every_rank(path: PathClass) -> None:
    envs = envs_for(path)
    assert len(envs) == 3
    wanted = G8_COMMON + (G8_RELAYED if path is PathClass.RELAYED else ())
    for env in envs:
        missing = [name for name in wanted if not env.get(name)]
        assert missing == []


@pytest.mark.parametrize("path", ALL_PATHS)
def test_g8_values_follow_the_path(path: PathClass) -> None:
    envs = envs_for(path)
    addresses = EXPECTED_ADDRESSES[path]
    for rank, env in enumerate(envs):
        assert env["NODUS_GANG_TRANSPORT"] == path.value
        assert env["MASTER_ADDR"] == addresses[0]
        assert env["MASTER_PORT"] == str(PORT)
        assert env["PET_RDZV_ENDPOINT"] == f"{addresses[0]}:{PORT}"
        assert env["PET_NNODES"] == "3"
        assert env["WORLD_SIZE"] == "3"
        assert env["PET_NODE_RANK"] == str(rank)
        assert env["NODE_RANK"] == str(rank)
        assert env["NODUS_NODE_IPS"] == ",".join(addresses)
        assert env["NCCL_SOCKET_IFNAME"] == EXPECTED_INTERFACE[path]
        assert env["GLOO_SOCKET_IFNAME"] == EXPECTED_INTERFACE[path]


@pytest.mark.parametrize("path", [PathClass.PRIVATE, PathClass.DIRECT])
def test_no_shim_variables_on_private_and_direct(path: PathClass) -> None:
    for env in envs_for(path):
        assert "LD_PRELOAD" not in env
        assert not [name for name in env if name.startswith("NODUS_NETSHIM_")]
        assert SHIM not in " ".join(env.values())


@pytest.mark.parametrize("path", [PathClass.PRIVATE, PathClass.DIRECT])
def test_image_preload_kept_alone_on_private_and_direct(path: PathClass) -> None:
    envs = envs_for(path, image={"env": {"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}})
    assert {env["LD_PRELOAD"] for env in envs} == {"/usr/lib/libjemalloc.so.2"}


def test_relayed_preload_is_the_shim_alone_when_the_image_has_none() -> None:
    for env in envs_for(PathClass.RELAYED):
        assert env["LD_PRELOAD"] == SHIM


def test_relayed_preload_is_the_shim_first_then_the_images_own() -> None:
    envs = envs_for(PathClass.RELAYED, image={"env": {"LD_PRELOAD": "/usr/lib/libjemalloc.so.2"}})
    for env in envs:
        assert env["LD_PRELOAD"] == f"{SHIM}:/usr/lib/libjemalloc.so.2"


def test_relayed_netshim_peers_are_the_other_members_addresses() -> None:
    envs = envs_for(PathClass.RELAYED)
    addresses = EXPECTED_ADDRESSES[PathClass.RELAYED]
    for rank, env in enumerate(envs):
        peers = env["NODUS_NETSHIM_PEERS"].split(",")
        assert sorted(peers) == sorted(a for i, a in enumerate(addresses) if i != rank)


def test_relayed_netshim_socks_is_the_members_agent() -> None:
    the_job, plan, records = planned(PathClass.RELAYED, 2)
    records["m1"].socks_endpoint = "127.0.0.1:1181"
    envs = rank_environments(the_job, plan, records, EPOCH, PORT, SHIM)
    assert [env["NODUS_NETSHIM_SOCKS"] for env in envs] == ["127.0.0.1:1080", "127.0.0.1:1181"]


def test_ipv6_master_gets_a_bracketed_rendezvous_and_inet6_family() -> None:
    records = [
        node_record(machine("m0", offering="container", address="fd00::1")),
        node_record(machine("m1", offering="container", address="fd00::2")),
    ]
    the_job = spec_for(PathClass.RELAYED, 2)
    plan, shortfalls = Planner(load_config()).plan(the_job, records)
    assert plan is not None, shortfalls
    envs = rank_environments(
        the_job, plan, {r.inventory.node: r for r in records}, EPOCH, PORT, SHIM
    )
    for env in envs:
        assert env["MASTER_ADDR"] == "fd00::1"
        assert env["PET_RDZV_ENDPOINT"] == f"[fd00::1]:{PORT}"
        assert env["NCCL_SOCKET_FAMILY"] == "AF_INET6"


@pytest.mark.parametrize("path", ALL_PATHS)
def test_ipv4_family(path: PathClass) -> None:
    assert {env["NCCL_SOCKET_FAMILY"] for env in envs_for(path)} == {"AF_INET"}


# -- the user's NCCL_* win, except those the path fixes ----------------------------------------


@pytest.mark.parametrize("path", ALL_PATHS)
def test_users_nccl_debug_wins(path: PathClass) -> None:
    envs = envs_for(path, env={"NCCL_DEBUG": "INFO", "NCCL_ALGO": "Ring"})
    for env in envs:
        assert env["NCCL_DEBUG"] == "INFO"
        assert env["NCCL_ALGO"] == "Ring"


def test_users_nccl_wins_over_the_images() -> None:
    envs = envs_for(
        PathClass.DIRECT, env={"NCCL_DEBUG": "INFO"}, image={"env": {"NCCL_DEBUG": "WARN"}}
    )
    assert {env["NCCL_DEBUG"] for env in envs} == {"INFO"}


@pytest.mark.parametrize("path", ALL_PATHS)
@pytest.mark.parametrize("where", ["env", "image"])
def test_path_fixed_nccl_variables_override_the_user(path: PathClass, where: str) -> None:
    user = {
        "NCCL_NET": "IB",
        "NCCL_SOCKET_IFNAME": "ib0",
        "NCCL_SOCKET_FAMILY": "AF_INET6",
        "NCCL_IB_DISABLE": "0",
        "GLOO_SOCKET_IFNAME": "ib0",
    }
    spec: dict[str, Any] = {"env": user} if where == "env" else {"image": {"env": user}}
    for env in envs_for(path, **spec):
        assert env["NCCL_NET"] == "Socket"
        assert env["NCCL_SOCKET_IFNAME"] == EXPECTED_INTERFACE[path]
        assert env["GLOO_SOCKET_IFNAME"] == EXPECTED_INTERFACE[path]
        assert env["NCCL_SOCKET_FAMILY"] == "AF_INET"
        assert env["NCCL_IB_DISABLE"] == "1"


def test_user_cannot_redirect_the_rendezvous() -> None:
    envs = envs_for(
        PathClass.DIRECT, env={"MASTER_ADDR": "1.2.3.4", "WORLD_SIZE": "99", "NODE_RANK": "7"}
    )
    for rank, env in enumerate(envs):
        assert env["MASTER_ADDR"] == EXPECTED_ADDRESSES[PathClass.DIRECT][0]
        assert env["WORLD_SIZE"] == "3"
        assert env["NODE_RANK"] == str(rank)


def test_other_user_variables_are_passed_through() -> None:
    envs = envs_for(
        PathClass.RELAYED,
        env={"HF_HOME": "/data/hf"},
        image={"env": {"PATH": "/opt/conda/bin:/usr/bin"}},
    )
    for env in envs:
        assert env["HF_HOME"] == "/data/hf"
        assert env["PATH"] == "/opt/conda/bin:/usr/bin"


# -- C5: backend-derived names -----------------------------------------------------------------


def test_cuda_names() -> None:
    for env in envs_for(PathClass.DIRECT, accelerators=CUDA):
        assert env["NODUS_DEVICES"] == "CUDA0,CUDA1,CUDA2,CUDA3"
        assert env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"
        assert "HIP_VISIBLE_DEVICES" not in env
        assert env["NODUS_COLLECTIVES"] == "nccl"
        assert env["NODUS_ACCELERATOR_BACKEND"] == "cuda"


def test_rocm_names() -> None:
    for env in envs_for(PathClass.DIRECT, accelerators=ROCM):
        assert env["NODUS_DEVICES"] == "ROCm0,ROCm1"
        assert env["HIP_VISIBLE_DEVICES"] == "0,1"
        assert "CUDA_VISIBLE_DEVICES" not in env
        assert env["NODUS_COLLECTIVES"] == "rccl"
        assert env["NODUS_ACCELERATOR_BACKEND"] == "rocm"


@pytest.mark.parametrize(
    ("accelerators", "var"), [(CUDA, "HIP_VISIBLE_DEVICES"), (ROCM, "CUDA_VISIBLE_DEVICES")]
)
@pytest.mark.parametrize("where", ["env", "image"])
def test_the_other_backends_visible_devices_variable_is_a_backend_mismatch(
    accelerators: dict[str, Any], var: str, where: str
) -> None:
    spec: dict[str, Any] = {"env": {var: "0"}} if where == "env" else {"image": {"env": {var: "0"}}}
    the_job, plan, records = planned(PathClass.DIRECT, 2, accelerators, **spec)
    with pytest.raises(NodusError) as caught:
        rank_environments(the_job, plan, records, EPOCH, PORT, SHIM)
    assert caught.value.code is ErrorCode.BACKEND_MISMATCH
    assert var in caught.value.message


def test_the_own_backends_visible_devices_variable_is_fine() -> None:
    envs = envs_for(PathClass.DIRECT, 2, ROCM, env={"HIP_VISIBLE_DEVICES": "0"})
    assert all("HIP_VISIBLE_DEVICES" in env for env in envs)


def test_a_node_whose_devices_contradict_its_backend_is_a_backend_mismatch() -> None:
    the_job, plan, records = planned(PathClass.DIRECT, 2, ROCM)
    record = records["m1"]
    record.inventory.accelerators.devices[0].name = "CUDA0"
    with pytest.raises(NodusError) as caught:
        rank_environments(the_job, plan, records, EPOCH, PORT, SHIM)
    assert caught.value.code is ErrorCode.BACKEND_MISMATCH
    assert "m1" in caught.value.message


def test_ranks_are_distinct_and_share_one_master() -> None:
    envs = envs_for(PathClass.RELAYED, 2)
    assert [env["NODE_RANK"] for env in envs] == ["0", "1"]
    assert len({env["MASTER_ADDR"] for env in envs}) == 1
    assert {env["NODUS_EPOCH"] for env in envs} == {str(EPOCH)}


def test_a_restarted_gang_knows_it_and_finds_its_checkpoints_in_every_epoch() -> None:
    """R17: ranks resume: how many epochs ran before, and one checkpoint directory per job."""
    the_job, plan, records = planned(PathClass.DIRECT, 2)
    first = rank_environments(the_job, plan, records, 1, PORT, SHIM, "/shared/ckpt/")
    assert {e["NODUS_RESTART_COUNT"] for e in first} == {"0"}
    the_job.status.runs = 2
    later = rank_environments(the_job, plan, records, 4, PORT, SHIM, "/shared/ckpt")
    assert {e["NODUS_RESTART_COUNT"] for e in later} == {"2"}
    assert {e["TORCHELASTIC_RESTART_COUNT"] for e in later} == {"2"}
    org, name = the_job.metadata.org, the_job.metadata.name
    dirs = {e["NODUS_CHECKPOINT_DIR"] for e in first + later}
    assert len(dirs) == 1 and dirs.pop().startswith(f"/shared/ckpt/{org}/{name}")
    assert "NODUS_CHECKPOINT_DIR" not in rank_environments(the_job, plan, records, 4, PORT, SHIM)[0]


@pytest.mark.parametrize("image_preload", ["", "/usr/lib/libjemalloc.so.2"])
def test_relayed_env_is_what_netshim_preload_env_renders(image_preload: str) -> None:
    """One rendering of the shim's variables: the placer's rank env is the rank's env without
    them, preloaded by `libs.netshim.preload_env` (what the shim's own tests run programs with),
    to the letter and in the same order."""
    from libs import netshim

    image = {"env": {"LD_PRELOAD": image_preload}} if image_preload else {}
    the_job, plan, records = planned(PathClass.RELAYED, 3, image=image)
    envs = rank_environments(the_job, plan, records, EPOCH, PORT, SHIM)
    for member, env in zip(plan.members, envs, strict=True):
        base = {k: v for k, v in env.items() if k not in G8_RELAYED}
        if image_preload:
            base["LD_PRELOAD"] = image_preload
        peers = [m.address for m in plan.members if m is not member]
        rendered = netshim.preload_env(
            base, peers=peers, socks=records[member.node].socks_endpoint, shim=SHIM
        )
        assert list(rendered.items()) == list(env.items())

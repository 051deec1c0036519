"""Each rank's environment (G8), with backend-derived names (C5)."""

from __future__ import annotations

import functools

from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.fleet import NodeRecord
from libs.contracts.jobs import Job, PathClass
from libs.netshim import shim_env
from services.placer.addresses import ip_family
from services.placer.planner import Plan

OTHER_BACKEND_VAR = {"cuda": "HIP_VISIBLE_DEVICES", "rocm": "CUDA_VISIBLE_DEVICES"}


@functools.cache
def _indexes(count: int) -> str:
    """0,1,..,count-1: what a rank's *_VISIBLE_DEVICES holds."""
    return ",".join(str(i) for i in range(count))


def _endpoint(address: str, port: int) -> str:
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def device_names(record: NodeRecord) -> list[str]:
    """CUDA0.. or ROCm0..: from the inventory's own device list, checked against its backend."""
    acc = record.inventory.accelerators
    prefix = "CUDA" if acc.backend == "cuda" else "ROCm"
    names = [device.name for device in acc.devices] or [f"{prefix}{i}" for i in range(acc.count)]
    wrong = [name for name in names if not name.startswith(prefix)]
    if wrong:
        raise NodusError(
            ErrorCode.BACKEND_MISMATCH,
            f"node {record.inventory.node} reports backend {acc.backend} but devices {wrong} (C5)",
        )
    return names


def check_backend_names(job: Job, backend: str) -> None:
    """A spec that names the other backend's variables would find no device at run time (C5)."""
    other = OTHER_BACKEND_VAR[backend]
    for source, env in (("spec.env", job.spec.env), ("spec.image.env", job.spec.image.env)):
        if other in env:
            raise NodusError(
                ErrorCode.BACKEND_MISMATCH,
                f"{source}.{other} is set but the gang's accelerator backend is {backend}",
                field=f"$.{source}.{other}",
            )


def checkpoint_dir(root: str, job: Job) -> str:
    """Per job, kept across its epochs, the same on every machine; a job applied again under
    the same name after a delete starts afresh (its admission time names it)."""
    where = f"{root.rstrip('/')}/{job.metadata.org}/{job.metadata.name}"
    created = job.status.created_time
    return f"{where}/{int(created.timestamp())}" if created is not None else where


def rank_environments(
    job: Job,
    plan: Plan,
    records: dict[str, NodeRecord],
    epoch: int,
    master_port: int,
    shim_path: str,
    checkpoint_root: str | None = None,
    devices: dict[str, list[str]] | None = None,
) -> list[dict[str, str]]:
    """The whole environment of every rank, in rank order. `devices`: each member's device
    names when the caller has them already (`device_names`)."""
    members = plan.members
    world = str(len(members))
    addresses = [member.address for member in members]
    node_ips = ",".join(addresses)
    master = addresses[0]
    family = "AF_INET6" if ip_family(master) == 6 else "AF_INET"
    user_env: dict[str, str] = dict(job.spec.image.env)
    user_env.update(job.spec.env)  # the user's values, NCCL_* included, win over the image's
    runs, epoch_text, port = str(job.status.runs), str(epoch), str(master_port)
    rdzv = _endpoint(master, master_port)
    checkpoint = checkpoint_dir(checkpoint_root, job) if checkpoint_root else None
    relayed = plan.path is PathClass.RELAYED
    preload = job.spec.env.get("LD_PRELOAD") or job.spec.image.env.get("LD_PRELOAD")
    checked: set[str] = set()
    envs: list[dict[str, str]] = []
    for member in members:
        record = records[member.node]
        acc = record.inventory.accelerators
        if acc.backend not in checked:
            check_backend_names(job, acc.backend)
            checked.add(acc.backend)
        names = devices[member.node] if devices is not None else device_names(record)
        rank = str(member.rank)
        env = dict(user_env)
        env.update(
            {
                "NODUS_GANG": job.key,
                "NODUS_EPOCH": epoch_text,
                # How many earlier epochs started this job's ranks: a restart resumes.
                "NODUS_RESTART_COUNT": runs,
                "TORCHELASTIC_RESTART_COUNT": runs,
                "NODUS_GANG_TRANSPORT": plan.path.value,
                "MASTER_ADDR": master,
                "MASTER_PORT": port,
                "PET_RDZV_ENDPOINT": rdzv,
                "PET_NNODES": world,
                "PET_NODE_RANK": rank,
                "NODE_RANK": rank,
                "RANK": rank,
                "WORLD_SIZE": world,
                "NODUS_NODE_IPS": node_ips,
                # The path fixes these four NCCL_*; every other one the user sets wins (G8).
                "NCCL_SOCKET_IFNAME": member.interface,
                "GLOO_SOCKET_IFNAME": member.interface,
                "NCCL_NET": "Socket",
                "NCCL_SOCKET_FAMILY": family,
                "NCCL_IB_DISABLE": "1",
                "NODUS_ACCELERATOR_BACKEND": acc.backend,
                "NODUS_COLLECTIVES": acc.collectives,
                "NODUS_DEVICES": ",".join(names),
                acc.visible_devices_var: _indexes(len(names)),
            }
        )
        if checkpoint is not None:
            env["NODUS_CHECKPOINT_DIR"] = checkpoint
        env.pop("LD_PRELOAD", None)
        if relayed:
            # The shim first, then the image's own preloads (G8).
            env.update(
                shim_env(
                    peers=[a for a in addresses if a != member.address],
                    socks=record.socks_endpoint,
                    shim=shim_path,
                    preload=job.spec.image.env.get("LD_PRELOAD", ""),
                )
            )
        elif preload:
            env["LD_PRELOAD"] = preload
        envs.append(env)
    return envs

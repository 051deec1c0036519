"""All-reduce with PyTorch's Gloo backend, started by torchrun on every member of a gang.

    python -m torch.distributed.run --nproc-per-node 1 examples/workloads/gloo_allreduce.py

torchrun takes the gang from the rank's environment (PET_NNODES, PET_NODE_RANK,
PET_RDZV_ENDPOINT, set by Nodus) and gives each worker RANK, WORLD_SIZE, MASTER_ADDR and
MASTER_PORT. Each worker all-reduces a float32 tensor of GLOO_ALLREDUCE_MIB MiB (default 64)
GLOO_ALLREDUCE_ITERS times (default 20), checks every element of every result, prints one JSON
line per iteration and a last one with "verified". Exit 0 only if every result was right.

Gloo binds the address of the interface GLOO_SOCKET_IFNAME names. When that interface does not
carry this member's own address (NODUS_NODE_IPS[node rank]: in the local lab every member's
address is a 127.x on `lo`, while the placer names `eth0` for the Relayed path), the worker
gives Gloo a device bound to the member's address instead, so peers dial the address the shim
redirects through the gang's tunnel. GLOO_ALLREDUCE_TIMEOUT (seconds, default 120) bounds every
collective.
"""

from __future__ import annotations

import datetime
import fcntl
import json
import os
import socket
import struct
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

SIOCGIFADDR = 0x8915


def interface_address(name: str) -> str | None:
    """The IPv4 address of interface `name` (what Gloo binds for GLOO_SOCKET_IFNAME)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(
                sock.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode())
            )
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def backend_for(own: str, timeout: datetime.timedelta) -> tuple[str, str]:
    """("gloo", why) when GLOO_SOCKET_IFNAME carries `own`; else a Gloo backend on `own`."""
    interface = os.environ.get("GLOO_SOCKET_IFNAME", "")
    carried = interface_address(interface) if interface else None
    if not own or carried == own:
        return "gloo", f"GLOO_SOCKET_IFNAME={interface} carries {carried}"

    def create(
        store: Any, rank: int, size: int, pg_timeout: datetime.timedelta
    ) -> dist.ProcessGroupGloo:
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=own)]
        options._timeout = pg_timeout
        return dist.ProcessGroupGloo(store, rank, size, options)

    dist.Backend.register_backend("gloo_at_address", create, devices=["cpu"])
    return "gloo_at_address", (
        f"GLOO_SOCKET_IFNAME={interface or '(unset)'} carries {carried or 'no IPv4 address'}, "
        f"not this member's {own}: Gloo bound to {own}"
    )


def main() -> int:
    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    node_rank = int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", rank)))
    addresses = [a for a in os.environ.get("NODUS_NODE_IPS", "").split(",") if a]
    own = addresses[node_rank] if node_rank < len(addresses) else ""
    size = int(os.environ.get("GLOO_ALLREDUCE_MIB", "64")) << 20
    iterations = int(os.environ.get("GLOO_ALLREDUCE_ITERS", "20"))
    timeout = datetime.timedelta(seconds=float(os.environ.get("GLOO_ALLREDUCE_TIMEOUT", "120")))

    backend, why = backend_for(own, timeout)
    started = time.monotonic()
    dist.init_process_group(backend=backend, rank=rank, world_size=world, timeout=timeout)
    print(json.dumps({"rank": rank, "world": world, "backend": backend, "device": why}), flush=True)
    count = size // 4
    base = torch.arange(count, dtype=torch.float32).remainder_(251)  # exact in float32
    offsets = sum((r + 1) * 1000 for r in range(world))
    verified = True
    times = []
    for iteration in range(iterations):
        tensor = base + ((rank + 1) * 1000 + iteration)
        t0 = time.monotonic()
        dist.all_reduce(tensor)  # SUM
        times.append(time.monotonic() - t0)
        expected = base * world + (offsets + world * iteration)
        ok = bool(torch.equal(tensor, expected))
        verified &= ok
        print(
            json.dumps(
                {
                    "rank": rank,
                    "iteration": iteration,
                    "ok": ok,
                    "seconds": round(times[-1], 3),
                }
            ),
            flush=True,
        )
    dist.destroy_process_group()
    print(
        json.dumps(
            {
                "rank": rank,
                "world": world,
                "bytes": size,
                "iterations": iterations,
                "slowestSeconds": round(max(times), 3),
                "totalSeconds": round(time.monotonic() - started, 3),
                "verified": verified,
            }
        ),
        flush=True,
    )
    return 0 if verified else 1


if __name__ == "__main__":
    sys.exit(main())

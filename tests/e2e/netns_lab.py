"""A fleet of the network-namespace lab (`nodus up --netns`) for end-to-end tests: VMs of
different providers for Direct gangs (L4s, some behind their provider's NAT), and VMs on one
provider's private network for Private gangs (A10s, so Direct jobs never land there)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from app.local import LocalSystem

L4 = {"count": 1, "backend": "cuda", "model": "L4"}
A10 = {"count": 1, "backend": "cuda", "model": "A10"}


def lab_system(
    root: Path,
    direct: list[tuple[str, str, str, bool]],
    private: list[tuple[str, str, str]],
) -> LocalSystem:
    """A LocalSystem in the lab (not started) on `direct` VMs (name, provider, address, behind
    NAT) and `private` ones (name, address, private address), heartbeats every second, a 2-s
    probe sample."""
    machines: list[dict[str, Any]] = [
        {
            "name": name,
            "provider": provider,
            "region": f"{provider}-1",
            "regionClass": "us",
            "offering": "vm",
            "address": address,
            "nat": nat,
            "pool": "l4",
            "cluster": "c",
            "accelerators": L4,
        }
        for name, provider, address, nat in direct
    ] + [
        {
            "name": name,
            "provider": "aws",
            "region": "us-east-1",
            "regionClass": "us",
            "offering": "vm",
            "address": address,
            "privateNetwork": "vpc",
            "privateAddress": private_address,
            "privateInterface": "ens5",
            "pool": "a10",
            "cluster": "c",
            "accelerators": A10,
        }
        for name, address, private_address in private
    ]
    fleet = root / "fleet.yaml"
    fleet.write_text(yaml.safe_dump({"machines": machines}))
    return LocalSystem(
        fleet_path=fleet,
        state_dir=root / "state",
        nats_port=4222,
        heartbeat_seconds=1.0,
        probe_seconds=2.0,
        netns=True,
    )

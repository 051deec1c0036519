"""Which WireGuard nodus0 runs (O5), decided as the agent decides it, with real `ip` calls in a
network namespace of this machine: this kernel has no WireGuard module, so `auto` falls back to
wireguard-go, `kernel` fails with the kernel's own reason (at the agent's start and at
nodus0's creation), `userspace` never asks the kernel; the agent's announcement (metric, the
warning about a build without offloads) follows the binary it runs. The kernel device's
configuration goes through `wg`, which also speaks to a wireguard-go device: that path is
driven here against a real one."""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.netlab import missing_requirements
from tests.integration.lab_programs import REPO

reason = missing_requirements() or (None if shutil.which("wireguard-go") else "no wireguard-go")
pytestmark = pytest.mark.skipif(reason is not None, reason=str(reason))

OLD_DEB = "wireguard-go=0.0.20220316-1+b4"

CHOOSE = """
import asyncio, json, logging, sys
import msgspec
from libs.contracts.errors import NodusError
from prometheus_client import generate_latest
from services.agent.direct import wireguard

logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")

async def main():
    try:
        info = await wireguard.for_agent("vm-a")
    except NodusError as error:
        print(json.dumps({"error": error.message}))
        return
    metric = [l for l in generate_latest().decode().splitlines()
              if l.startswith("nodus_agent_wireguard_info{")]
    print(json.dumps({"info": msgspec.to_builtins(info), "metric": metric}))

asyncio.run(main())
"""

# nodus0 made as a member makes it, configured and read through `wg` (the kernel's way).
THROUGH_WG = """
import asyncio, json, os, sys
from libs.contracts.errors import NodusError
from libs.wg import generate_private_key, public_key
from libs.wg.uapi import DeviceConfig, PeerConfig
from services.agent.direct.nodus0 import Nodus0, device_exists

async def main():
    if os.environ.get("NODUS_WIREGUARD") == "kernel":
        try:
            await Nodus0().create("100.64.0.1", 24)
        except NodusError as error:
            print(json.dumps({"error": error.message, "left": device_exists("nodus0")}))
        return
    device = Nodus0(control="wg")
    await device.create("100.64.0.1", 24)
    peer, other = public_key(generate_private_key()), public_key(generate_private_key())
    await device.configure(DeviceConfig(
        private_key=generate_private_key(), listen_port=51820,
        peers=(PeerConfig(peer, ("100.64.0.2/32",), "198.18.2.1:51820", 15),
               PeerConfig(other, ("100.64.0.3/32",))),
    ))
    first = await device.state()
    await device.configure(DeviceConfig(replace_peers=True, peers=(PeerConfig(peer, ("100.64.0.2/32",)),)))
    second = await device.state()
    await device.close()
    print(json.dumps({
        "implementation": device.wireguard.implementation,
        "port": first.listen_port,
        "peers": len(first.peers),
        "endpoint": first.peers[peer].endpoint,
        "allowed": first.peers[peer].allowed_ips,
        "keepalive": first.peers[peer].persistent_keepalive,
        "after_replace": [p.hex() for p in second.peers],
        "peer": peer.hex(),
        "gone": not device_exists("nodus0"),
    }))

asyncio.run(main())
"""


@pytest.fixture
def namespace() -> Iterator[str]:
    name = f"nwgc-{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def _run(namespace: str, script: str, **env: str) -> tuple[dict[str, Any], str]:
    # A mount namespace with its own /var/run/wireguard, as a lab machine has (app/netlab).
    private = 'mkdir -p /var/run/wireguard && mount -t tmpfs nwgc /var/run/wireguard && exec "$@"'
    done = subprocess.run(
        [
            *("ip", "netns", "exec", namespace, "sh", "-c", private, "sh"),
            sys.executable,
            "-c",
            script,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin", **env},
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def _kernel_has_wireguard(namespace: str) -> bool:
    tried = subprocess.run(
        ["ip", "-n", namespace, "link", "add", "nwgprobe", "type", "wireguard"], capture_output=True
    )
    subprocess.run(["ip", "-n", namespace, "link", "del", "nwgprobe"], capture_output=True)
    return tried.returncode == 0


def test_auto_takes_the_kernel_if_it_creates_a_device_else_wireguard_go(namespace: str) -> None:
    result, _ = _run(namespace, CHOOSE, NODUS_WIREGUARD="auto")
    info = result["info"]
    assert isinstance(info, dict)
    if _kernel_has_wireguard(namespace):  # a real VM's kernel
        assert info["implementation"] == "kernel" and info["offloads"] is True
    else:  # this machine
        assert info["implementation"] == "wireguard-go"
        assert info["binary"] == shutil.which("wireguard-go")
    (metric,) = result["metric"]
    assert f'implementation="{info["implementation"]}"' in metric
    assert f'version="{info["version"]}"' in metric and metric.endswith(" 1.0")
    # The probe's throwaway devices are gone.
    links = subprocess.run(["ip", "-n", namespace, "-j", "link"], capture_output=True, text=True)
    assert [link["ifname"] for link in json.loads(links.stdout)] == ["lo"]


def test_forced_kernel_without_the_module_fails_with_the_kernels_reason(namespace: str) -> None:
    if _kernel_has_wireguard(namespace):
        pytest.skip("this kernel has WireGuard")
    result, _ = _run(namespace, CHOOSE, NODUS_WIREGUARD="kernel")
    error = str(result["error"])
    assert "NODUS_WIREGUARD=kernel" in error and "Unknown device type" in error
    made, _ = _run(namespace, THROUGH_WG, NODUS_WIREGUARD="kernel")
    assert "Unknown device type" in str(made["error"]) and made["left"] is False


def test_forced_userspace_and_a_missing_binary(namespace: str) -> None:
    result, _ = _run(namespace, CHOOSE, NODUS_WIREGUARD="userspace")
    assert result["info"]["implementation"] == "wireguard-go"
    missing, _ = _run(
        namespace, CHOOSE, NODUS_WIREGUARD="userspace", NODUS_WIREGUARD_GO="/nonexistent/wg-go"
    )
    assert "wireguard-go is not installed (/nonexistent/wg-go" in str(missing["error"])
    # auto without any WireGuard: the agent starts, announcing none.
    none, stderr = _run(namespace, CHOOSE, NODUS_WIREGUARD_GO="/nonexistent/wg-go")
    bad, _ = _run(namespace, CHOOSE, NODUS_WIREGUARD="bogus")
    assert "one of auto, kernel, userspace" in str(bad["error"])
    if not _kernel_has_wireguard(namespace):
        assert none["info"] is None and "no WireGuard for Direct gangs" in stderr


def test_a_build_without_offloads_is_announced_and_warned_about(
    namespace: str, tmp_path: Path
) -> None:
    """bookworm's own build, extracted from its .deb beside the installed one."""
    download = subprocess.run(
        ["apt-get", "download", OLD_DEB], cwd=tmp_path, capture_output=True, text=True
    )
    if download.returncode != 0:
        pytest.skip(f"bookworm's wireguard-go cannot be downloaded here: {download.stderr[-200:]}")
    [deb] = tmp_path.glob("wireguard-go_*.deb")
    subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp_path / "old")], check=True)
    binary = tmp_path / "old/usr/bin/wireguard-go"
    result, stderr = _run(
        namespace, CHOOSE, NODUS_WIREGUARD="userspace", NODUS_WIREGUARD_GO=str(binary)
    )
    assert result["info"] == {  # no package owns it: its --version
        "implementation": "wireguard-go",
        "version": "0.0.20220316",
        "offloads": False,
        "binary": str(binary),
    }
    assert "has no TUN/UDP offloads" in stderr
    assert 'offloads="false"' in result["metric"][0]


def test_nodus0_configured_and_read_through_wg(namespace: str) -> None:
    result, _ = _run(namespace, THROUGH_WG, NODUS_WIREGUARD="userspace")
    assert result["implementation"] == "wireguard-go"
    assert result["port"] == 51820 and result["peers"] == 2
    assert result["endpoint"] == "198.18.2.1:51820"
    assert result["allowed"] == ["100.64.0.2/32"] and result["keepalive"] == 15
    assert result["after_replace"] == [result["peer"]]
    assert result["gone"] is True

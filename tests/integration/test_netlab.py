"""The network-namespace lab with real packets: machines of two providers reach each other,
a machine behind NAT is seen at its router's address and cannot be reached at its own, a
private network carries its members only, the control plane is reachable from every machine
and from the host, and everything the lab made is gone after it stops (or crashed)."""

from __future__ import annotations

import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from app.netlab import CONTROL_ADDRESS, NetLab, in_namespace, missing_requirements, plan
from app.netlab.lab import REGISTER, _existing_namespaces, clean_abandoned
from libs.contracts.base import convert
from libs.contracts.errors import NodusError
from libs.contracts.fleet import Fleet
from tests.integration.lab_programs import run_python, seen_by

pytestmark = pytest.mark.skipif(
    missing_requirements() is not None, reason=str(missing_requirements())
)

ACCELERATORS = {"count": 1, "backend": "cuda", "model": "L4"}


def _machine(
    name: str, provider: str, region: str, address: str, **extra: object
) -> dict[str, object]:
    return {
        "name": name,
        "provider": provider,
        "region": region,
        "regionClass": "us",
        "offering": "vm",
        "address": address,
        "pool": "p",
        "cluster": "c",
        "accelerators": ACCELERATORS,
        **extra,
    }


FLEET = convert(
    {
        "machines": [
            _machine(
                "aws-a",
                "aws",
                "us-east-1",
                "198.18.1.1",
                privateNetwork="vpc",
                privateAddress="198.18.100.1",
                privateInterface="ens5",
            ),
            _machine(
                "aws-b",
                "aws",
                "us-east-1",
                "198.18.1.2",
                privateNetwork="vpc",
                privateAddress="198.18.100.2",
                privateInterface="ens5",
            ),
            _machine("lambda-a", "lambda", "us-west-1", "198.18.2.1"),
            _machine("home-a", "home", "us-west-1", "198.19.3.1", nat=True),
            _machine("home-b", "home", "us-west-1", "198.19.3.2", nat=True),
        ]
    },
    Fleet,
)


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[NetLab]:
    netlab = NetLab(plan(FLEET, prefix=f"nt{secrets.token_hex(2)}-"), tmp_path / "lab.json")
    netlab.create()
    try:
        yield netlab
    finally:
        netlab.destroy()


def test_machines_of_two_providers_reach_each_other_at_their_addresses(lab: NetLab) -> None:
    aws, lam = (lab.machine_argv(m, []) for m in ("aws-a", "lambda-a"))
    assert seen_by(lam, "198.18.2.1", aws, "198.18.2.1") == "198.18.1.1"
    assert seen_by(aws, "198.18.1.1", lam, "198.18.1.1") == "198.18.2.1"


def test_a_machine_behind_nat_is_seen_at_its_router_and_unreachable_at_its_own_address(
    lab: NetLab,
) -> None:
    home, lam = (lab.machine_argv(m, []) for m in ("home-a", "lambda-a"))
    [router] = [lan for lan in lab.topology.lans if lan.nat]
    assert seen_by(lam, "198.18.2.1", home, "198.18.2.1") == str(router.uplink)
    assert seen_by(home, "198.19.3.1", lam, "198.19.3.1") == "unreachable"
    # Behind the same NAT, the LAN itself is open.
    assert seen_by(home, "198.19.3.1", lab.machine_argv("home-b", []), "198.19.3.1") == "198.19.3.2"


def test_a_private_network_carries_its_members_only(lab: NetLab) -> None:
    a, b, lam = (lab.machine_argv(m, []) for m in ("aws-a", "aws-b", "lambda-a"))
    assert seen_by(b, "198.18.100.2", a, "198.18.100.2") == "198.18.100.1"
    assert seen_by(b, "198.18.100.2", lam, "198.18.100.2") == "unreachable"


def test_the_control_plane_is_reachable_from_every_machine_and_from_the_host(lab: NetLab) -> None:
    control = in_namespace(lab.topology.control, [])
    for machine in lab.topology.machines:
        seen = seen_by(
            control, str(CONTROL_ADDRESS), lab.machine_argv(machine, []), str(CONTROL_ADDRESS)
        )
        assert seen != "unreachable", machine
    assert seen_by(control, str(CONTROL_ADDRESS), [], str(CONTROL_ADDRESS)) == "198.18.255.253"


def test_each_machine_has_its_own_wireguard_control_directory(lab: NetLab) -> None:
    marker = f"/var/run/wireguard/nodus0-{secrets.token_hex(3)}.sock"
    write = f"open({marker!r}, 'w').close(); import os; print(os.path.exists({marker!r}))"
    look = f"import os; print(os.path.exists({marker!r}))"
    assert run_python(lab.machine_argv("aws-a", []), write) == "True"
    assert run_python(lab.machine_argv("aws-b", []), look) == "False"
    assert not Path(marker).exists()


def test_a_crashed_lab_is_cleaned_at_the_next_start_and_nothing_is_left_after_it_stops(
    tmp_path: Path,
) -> None:
    topology = plan(FLEET, prefix=f"nt{secrets.token_hex(2)}-")
    state = tmp_path / "lab.json"
    crashed = NetLab(topology, state)
    crashed.create()
    # A process left running in a machine (an agent of the crashed run).
    leftover = subprocess.Popen(crashed.machine_argv("aws-a", ["sleep", "60"]))
    again = NetLab(topology, state)  # the next `nodus up`: same state file, no destroy between
    again.create()
    assert leftover.wait(timeout=5) != 0  # killed by the clean-up
    assert set(topology.namespaces) <= _existing_namespaces()
    again.destroy()
    assert not set(topology.namespaces) & _existing_namespaces()
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    assert topology.host_link is not None and topology.host_link not in links
    assert not state.exists()


LAB_IN_A_PROCESS = """
import sys, time
from pathlib import Path
from app.netlab import NetLab, plan
from tests.integration.test_netlab import FLEET
NetLab(plan(FLEET, prefix=sys.argv[1]), Path(sys.argv[2])).create()
print("up", flush=True)
time.sleep(120)
"""


def _lab_in_a_process(prefix: str, state: Path) -> subprocess.Popen[str]:
    """A lab reachable from the host, made and held by a process of its own (another run)."""
    process = subprocess.Popen(
        [sys.executable, "-c", LAB_IN_A_PROCESS, prefix, str(state)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None and process.stdout.readline().strip() == "up"
    return process


def _links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "by-an-older-version"])
def test_a_lab_whose_run_was_killed_is_cleaned_by_the_next_lab_of_any_prefix(
    tmp_path: Path, recorded: bool
) -> None:
    """A run killed with its lab up (a CI job stopped at its deadline) must not hold the host's
    route for the next run, whose labs have prefixes and state files of their own."""
    old_prefix = f"nk{secrets.token_hex(2)}-"
    old = plan(FLEET, prefix=old_prefix)
    holder = _lab_in_a_process(old_prefix, tmp_path / "old.json")
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=5)
    if not recorded:  # a version before the register wrote only its own state file
        (REGISTER / f"{old_prefix.rstrip('-')}.json").unlink()
        (tmp_path / "old.json").unlink()
    assert set(old.namespaces) <= _existing_namespaces()
    new = NetLab(plan(FLEET, prefix=f"nt{secrets.token_hex(2)}-"), tmp_path / "new.json")
    new.create()
    try:
        assert not set(old.namespaces) & _existing_namespaces()
        assert old.host_link is not None and old.host_link not in _links()
        assert set(new.topology.namespaces) <= _existing_namespaces()
    finally:
        new.destroy()
    assert not (REGISTER / f"{new.topology.prefix.rstrip('-')}.json").exists()


def test_a_running_lab_s_route_is_refused_with_the_process_that_holds_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NODUS_LAB_ROUTE_WAIT", "0")  # as `nodus up` does: refused at once
    held_prefix = f"nl{secrets.token_hex(2)}-"
    holder = _lab_in_a_process(held_prefix, tmp_path / "held.json")
    try:
        other = NetLab(plan(FLEET, prefix=f"nt{secrets.token_hex(2)}-"), tmp_path / "other.json")
        with pytest.raises(NodusError, match=rf"for the lab of process {holder.pid} "):
            other.create()
        assert not set(other.topology.namespaces) & _existing_namespaces()
    finally:
        holder.terminate()
        holder.wait(timeout=5)
    assert held_prefix.rstrip("-") in clean_abandoned()
    assert not set(plan(FLEET, prefix=held_prefix).namespaces) & _existing_namespaces()


def test_a_lab_waits_for_the_route_while_another_run_s_lab_holds_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A test run beside another on one host network: the lab waits (NODUS_LAB_ROUTE_WAIT)
    until the other's lab is gone, then takes the route."""
    monkeypatch.setenv("NODUS_LAB_ROUTE_WAIT", "30")
    holder = _lab_in_a_process(f"nw{secrets.token_hex(2)}-", tmp_path / "held.json")
    ends = threading.Timer(2.0, holder.terminate)  # the other run ends its lab (and dies)
    ends.start()
    lab = NetLab(plan(FLEET, prefix=f"nt{secrets.token_hex(2)}-"), tmp_path / "waits.json")
    try:
        started = time.monotonic()
        lab.create()
        assert time.monotonic() - started >= 1.5  # it waited for the holder to end
        assert set(lab.topology.namespaces) <= _existing_namespaces()
    finally:
        ends.cancel()
        holder.wait(timeout=10)
        lab.destroy()


def test_a_fleet_the_lab_cannot_build_is_refused_with_what_to_change() -> None:
    outside = convert({"machines": [_machine("x", "aws", "r", "10.0.0.1")]}, Fleet)
    with pytest.raises(NodusError, match=r"10\.0\.0\.1 is outside 198\.18\.0\.0/15"):
        plan(outside)
    split = convert(
        {
            "machines": [
                _machine("x", "aws", "r", "198.18.1.1"),
                _machine("y", "aws", "r", "198.18.2.1"),
            ]
        },
        Fleet,
    )
    with pytest.raises(NodusError, match=r"aws r \(x, y\) spans .*share one /24"):
        plan(split)
    router = convert({"machines": [_machine("x", "aws", "r", "198.18.1.254")]}, Fleet)
    with pytest.raises(NodusError, match="kept for the network, broadcast or router"):
        plan(router)

"""G13 with real programs: iperf3 runs between two lab VMs' mesh addresses over `nodus0` (one
VM behind its provider's NAT); UDP is cut in one VM's namespace in the middle of the run, so
the direct path is gone, and the relay carrying the pair is SIGKILLed while it does (the
other, meshed relay takes over); then UDP is restored. iperf3 exits 0 with bytes moving
in every second but those in which the cut was being noticed (before the cut, while the
relays carried the pair, around the kill, after the restore); both members say
`derp:<region>` within 10 s of the cut, and `direct` again once UDP is back; the members'
logs hold no traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from app.demo import lab_unavailable
from app.netlab import NetLab
from tests.integration.direct_lab import Members, direct_members
from tests.integration.lab_programs import lab_fleet, running_lab

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(lab_unavailable() is not None, reason=str(lab_unavailable())),
    pytest.mark.skipif(
        shutil.which("iperf3") is None, reason="no iperf3 (deploy/dev/system-deps.sh)"
    ),
]

MACHINES = [
    ("lambda-a", "198.18.2.1", "100.64.9.1"),
    ("home-b", "198.19.3.1", "100.64.9.2"),
]
FLEET = lab_fleet(
    ("lambda-a", "lambda", "198.18.2.1", False), ("home-b", "home", "198.19.3.1", True)
)
SECONDS = 24
CUT_AT, KILL_AT, RESTORE_AT = 5.0, 10.0, 16.0

CUT = """table inet nodus_test_cut {
  chain out { type filter hook output priority filter; oifname "eth0" meta l4proto udp drop; }
  chain in { type filter hook input priority filter; iifname "eth0" meta l4proto udp drop; }
}
"""


@pytest.fixture
def lab(tmp_path: Path) -> Iterator[NetLab]:
    with running_lab(FLEET, tmp_path / "lab.json", reach_from_host=True) as netlab:
        yield netlab


def _until(check: Callable[[], bool], limit: float) -> float | None:
    """Seconds until `check()` held, polling; None if it did not within `limit`."""
    began = time.monotonic()
    while time.monotonic() - began < limit:
        if check():
            return time.monotonic() - began
        time.sleep(0.25)
    return None


def _all(members: Members, prefix: str) -> bool:
    return all(path.startswith(prefix) for path in _paths(members).values())


def _paths(members: Members) -> dict[str, str]:
    """Each member's path to each peer: `machine->peer` -> direct, derp:REGION or none."""
    return {
        f"{name}->{peer}": path
        for name, *_ in MACHINES
        for peer, path in members.paths(name).items()
    }


def test_udp_cut_mid_iperf3_falls_back_to_the_relays_and_comes_back(
    lab: NetLab, tmp_path: Path
) -> None:
    with direct_members(lab, tmp_path, MACHINES, relays=2) as members:
        for name, report in members.reports.items():
            assert report["failures"] == {}, (name, report)
        server = subprocess.Popen(
            lab.machine_argv("home-b", ["iperf3", "-s", "-1", "-B", "100.64.9.2"]),
            stdout=subprocess.DEVNULL,
        )
        members.others.append(server)
        time.sleep(0.5)
        client = subprocess.Popen(
            lab.machine_argv(
                "lambda-a",
                ["iperf3", "-c", "100.64.9.2", "-t", str(SECONDS), "-b", "200M", "--json"],
            ),
            stdout=subprocess.PIPE,
            text=True,
        )
        members.others.append(client)
        began = time.monotonic()
        time.sleep(CUT_AT)
        cut = subprocess.run(
            lab.machine_argv("lambda-a", ["nft", "-f", "-"]), input=CUT, text=True, check=True
        )
        assert cut.returncode == 0
        degraded = _until(lambda: _all(members, "derp:"), 10.0)
        assert degraded is not None, (
            f"not all on the relays 10 s after UDP was cut: {_paths(members)}; see {tmp_path}"
        )
        time.sleep(max(0.0, KILL_AT - (time.monotonic() - began)))
        relay = members.others[0]  # relay-0: who is homed on it moves to relay-1 (meshed)
        relay.kill()
        relay.wait()
        time.sleep(max(0.0, RESTORE_AT - (time.monotonic() - began)))
        subprocess.run(
            lab.machine_argv("lambda-a", ["nft", "delete", "table", "inet", "nodus_test_cut"]),
            check=True,
        )
        restored = _until(lambda: _all(members, "direct"), 40.0)
        out, _ = client.communicate(timeout=SECONDS + 30)
        assert client.returncode == 0, out[-2000:]
        report = json.loads(out)
        # Bytes moved in every second of the run but those in which the cut was being noticed:
        # from the cut until TCP's first resend after the fallback (its timer backed off
        # meanwhile). Then in every one: while the relays carried the pair, when the relay
        # carrying it died, when the direct path came back.
        seconds = {int(i["sum"]["start"]): i["sum"]["bytes"] for i in report["intervals"]}
        assert len(seconds) >= SECONDS, seconds
        resumed = min((t for t, b in seconds.items() if t > CUT_AT + degraded and b), default=-1)
        assert 0 <= resumed < KILL_AT, seconds  # the relays carried the pair when one was killed
        assert all(b > 0 for t, b in seconds.items() if not CUT_AT <= t < resumed), seconds
        assert report["end"]["sum_received"]["bytes"] > 0
        assert restored is not None, (
            f"not direct again 40 s after UDP came back: {_paths(members)}; see {tmp_path}"
        )
        # And the other way, direct again: home-b (behind its NAT) sends to lambda-a.
        back = subprocess.Popen(
            lab.machine_argv("lambda-a", ["iperf3", "-s", "-1", "-B", "100.64.9.1"]),
            stdout=subprocess.DEVNULL,
        )
        members.others.append(back)
        time.sleep(0.5)
        reverse = subprocess.run(
            lab.machine_argv("home-b", ["iperf3", "-c", "100.64.9.1", "-t", "3", "--json"]),
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert reverse.returncode == 0, reverse.stdout[-2000:]
        assert json.loads(reverse.stdout)["end"]["sum_received"]["bytes"] > 0
        for name, *_ in MACHINES:
            logged = next(tmp_path.glob(f"{name}.*.log")).read_text()
            assert "Traceback" not in logged and "crashed" not in logged, logged[-2000:]
        print(f"fallback after {degraded:.1f} s; direct again {restored:.1f} s after the restore")


RESCUE_SECONDS_RUN = 26
RESCUE_CUT_AT, RESCUE_KILL_AT = 4.0, 8.0


def test_a_pair_falling_back_outlives_both_of_its_relays_lost(lab: NetLab, tmp_path: Path) -> None:
    """UDP cut, so the pair goes through relay-0 and relay-1, then both are SIGKILLed and never
    come back (their host lost): after their 5-s wait both members are given relay-2 (meshed
    with the others) and iperf3 goes on to its end through it."""
    with direct_members(lab, tmp_path, MACHINES, relays=3) as members:
        server = subprocess.Popen(
            lab.machine_argv("home-b", ["iperf3", "-s", "-1", "-B", "100.64.9.2"]),
            stdout=subprocess.DEVNULL,
        )
        members.others.append(server)
        time.sleep(0.5)
        iperf3 = ["iperf3", "-c", "100.64.9.2", "-t", str(RESCUE_SECONDS_RUN), "-b", "100M"]
        client = subprocess.Popen(
            lab.machine_argv("lambda-a", [*iperf3, "--json"]),
            stdout=subprocess.PIPE,
            text=True,
        )
        members.others.append(client)
        began = time.monotonic()
        time.sleep(RESCUE_CUT_AT)
        subprocess.run(
            lab.machine_argv("lambda-a", ["nft", "-f", "-"]), input=CUT, text=True, check=True
        )
        degraded = _until(lambda: _all(members, "derp:"), 10.0)
        assert degraded is not None, (
            f"not all on the relays 10 s after UDP was cut: {_paths(members)}; see {tmp_path}"
        )
        time.sleep(max(0.0, RESCUE_KILL_AT - (time.monotonic() - began)))
        for relay in members.others[:2]:  # the pair's two relays, by name: relay-0, relay-1
            relay.kill()
            relay.wait()
        try:
            out, _ = client.communicate(timeout=RESCUE_SECONDS_RUN + 30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"iperf3 stalled once both relays were lost: see {tmp_path}")
        assert client.returncode == 0, out[-2000:]
        report = json.loads(out)
        seconds = {int(i["sum"]["start"]): i["sum"]["bytes"] for i in report["intervals"]}
        # Through relay-2 after the members' 5-s wait and TCP's backed-off resend: bytes move
        # again (measured 6 s after the kill), and once TCP has recovered (a second or two of
        # its slow start) in every second to the end.
        resumed = min((t for t, b in seconds.items() if t > RESCUE_KILL_AT and b), default=-1)
        assert RESCUE_KILL_AT < resumed < RESCUE_SECONDS_RUN - 6, seconds
        assert all(b > 0 for t, b in seconds.items() if t >= resumed + 3), seconds
        for name, *_ in MACHINES:
            log = next(tmp_path.glob(f"{name}.*.log")).read_text()
            assert "adding relay relay-2" in log, f"{name}: see {tmp_path}"

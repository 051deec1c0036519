"""The `nodus` command as a user runs it: `nodus up` in the background, then apply, get, env,
describe, delete from another shell, and Ctrl-C stopping everything."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from libs.bus.server import free_port
from tests.e2e.daemon_logs import DaemonLogs
from tests.e2e.nodus_cli import nodus_on

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
NODUS = str(Path(sys.executable).parent / "nodus")


def nodus(url: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return nodus_on(url, *args, check=check)


@pytest.fixture(scope="module")
def system(
    tmp_path_factory: pytest.TempPathFactory, daemon_logs: DaemonLogs
) -> Iterator[tuple[str, subprocess.Popen[str], Path]]:
    state = tmp_path_factory.mktemp("state")
    daemon_logs.watch(state / "logs")
    port = free_port()
    up = subprocess.Popen(
        [NODUS, "up", "--nats-port", str(port), "--state-dir", str(state)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    assert up.stdout is not None
    line = up.stdout.readline()  # blocks until ready (or `nodus up` exits)
    if not line.startswith("NODUS_NATS_URL="):
        up.kill()
        pytest.fail(
            f"nodus up did not become ready: {line!r} {up.stderr.read() if up.stderr else ''}"
        )
    url = line.strip().split("=", 1)[1]
    assert url == f"nats://127.0.0.1:{port}"
    yield url, up, state
    if up.poll() is None:
        up.kill()
        up.wait()


def wait_for(check: object, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():  # type: ignore[operator]
            return
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout}s")


def test_up_runs_every_machine_and_keeps_their_files_in_the_state_dir(
    system: tuple[str, subprocess.Popen[str], Path],
) -> None:
    url, _, state = system
    nodes = json.loads(nodus(url, "get", "nodes", "-o", "json").stdout)
    fleet = yaml.safe_load((REPO / "examples" / "fleet.yaml").read_text())
    assert sorted(n["inventory"]["node"] for n in nodes) == sorted(
        m["name"] for m in fleet["machines"]
    )
    assert all(n["health"]["healthy"] for n in nodes)
    assert {n["inventory"]["address"] for n in nodes} == {m["address"] for m in fleet["machines"]}
    for machine in fleet["machines"]:
        assert (state / "machines" / machine["name"]).is_dir()
    table = nodus(url, "get", "nodes").stdout
    assert "aws-use1-a" in table and "Ready" in table


def test_apply_get_env_describe_delete(system: tuple[str, subprocess.Popen[str], Path]) -> None:
    url, _, _ = system
    applied = nodus(url, "apply", "-f", "examples/jobs/private.yaml")
    assert "job/llama-ft created" in applied.stdout
    # Placed, then probed and run: the example all-reduce on the private gang ends Succeeded.
    wait_for(
        lambda: (
            nodus(url, "get", "job", "llama-ft", "-o", "jsonpath={.status.phase}").stdout.strip()
            == "Succeeded"
        ),
        timeout=90,
    )

    listed = json.loads(nodus(url, "get", "jobs", "-o", "json").stdout)
    assert [j["metadata"]["name"] for j in listed] == ["llama-ft"]
    document = yaml.safe_load(nodus(url, "get", "job", "llama-ft", "-o", "yaml").stdout)
    assert document["apiVersion"] == "nodus/v1" and document["kind"] == "Job"
    assert document["status"]["gang"]["transport"] == "private"
    members = nodus(
        url, "get", "job", "llama-ft", "-o", "jsonpath={.status.gang.members[*].node}"
    ).stdout.split()
    assert len(members) == 2

    logs = nodus(url, "logs", "llama-ft", "--rank", "1").stdout
    assert '"verified": true' in logs
    env = dict(
        line.split("=", 1)
        for line in nodus(url, "env", "llama-ft", "--rank", "1").stdout.splitlines()
    )
    assert env["NODE_RANK"] == "1" and env["NODUS_GANG_TRANSPORT"] == "private"
    assert env["NCCL_DEBUG"] == "INFO"

    described = nodus(url, "describe", "job", "llama-ft").stdout
    for text in (
        "Phase:         Succeeded",
        "Members:",
        "GangReady",
        "NetworkQualified",
        "Probe:",
        "Billing:",
        "Events:",
        "placed on",
    ):
        assert text in described, described

    nodus(url, "delete", "job", "llama-ft")
    missing = nodus(url, "get", "job", "llama-ft", check=False)
    assert missing.returncode == 1 and "not found" in missing.stderr


def test_a_refused_apply_exits_non_zero_with_the_reason(
    system: tuple[str, subprocess.Popen[str], Path],
) -> None:
    url, _, _ = system
    refused = nodus(url, "apply", "-f", "examples/jobs/refused-no-access.yaml", check=False)
    assert refused.returncode == 1
    assert "DistributedAccessDenied" in refused.stderr and "hooli" in refused.stderr
    invalid = nodus(url, "apply", "-f", "examples/jobs/refused-invalid.yaml", check=False)
    assert invalid.returncode == 1 and "$.spec.distributed.members" in invalid.stderr
    assert json.loads(nodus(url, "get", "jobs", "-o", "json").stdout) == []


def relay_pid(state: Path, name: str) -> int | None:
    """The pid of this system's relay `name` (its usage journal is in this state dir)."""
    journal = (state / "relays" / f"{name}.usage").resolve()
    found = subprocess.run(
        ["pgrep", "-f", f"relay --name {name} .*{journal}"], capture_output=True, text=True
    )
    pids = [int(p) for p in found.stdout.split()]
    return pids[0] if pids else None


def test_a_relay_that_dies_is_started_again(
    system: tuple[str, subprocess.Popen[str], Path],
) -> None:
    """`nodus up` keeps its relays as systemd's Restart= would: a killed relay comes back on
    the same address and journal, and the rest of the system never notices."""
    _, up, state = system
    before = relay_pid(state, "relay-0")
    assert before is not None
    os.kill(before, signal.SIGKILL)
    wait_for(lambda: relay_pid(state, "relay-0") not in (None, before), timeout=20)
    assert up.poll() is None


def daemon_pid(state: Path, pattern: str) -> int | None:
    """The pid of this system's daemon whose command line matches `pattern` (and names a file
    of this state dir)."""
    found = subprocess.run(
        ["pgrep", "-f", f"{pattern}.*{state.resolve()}"], capture_output=True, text=True
    )
    pids = [int(p) for p in found.stdout.split()]
    return pids[0] if pids else None


def test_a_killed_agent_and_placer_are_started_again_on_the_same_boot(
    system: tuple[str, subprocess.Popen[str], Path],
) -> None:
    """`nodus up` supervises every daemon, not only relays: a SIGKILLed agent or placer comes
    back and the system goes on. The agent is back on the same boot (O4: a crash is not a
    reboot), healthy."""
    url, up, state = system
    node = "aws-use1-a"

    def boot_of() -> str:
        nodes = json.loads(nodus(url, "get", "nodes", "-o", "json").stdout)
        found = next(n for n in nodes if n["inventory"]["node"] == node)
        assert found["health"]["healthy"], found
        return str(found["bootId"])

    boot = boot_of()
    assert boot
    for pattern in (f"agent --node {node} ", "placer --replica placer-0 "):
        before = daemon_pid(state, pattern)
        assert before is not None, pattern
        os.kill(before, signal.SIGKILL)
        wait_for(lambda p=pattern, b=before: daemon_pid(state, p) not in (None, b), timeout=20)
    assert up.poll() is None
    wait_for(lambda: nodus(url, "get", "jobs", check=False).returncode == 0, timeout=30)
    assert boot_of() == boot


def test_ctrl_c_stops_everything(system: tuple[str, subprocess.Popen[str], Path]) -> None:
    url, up, state = system
    up.send_signal(signal.SIGINT)
    assert up.wait(timeout=30) == 0
    left = subprocess.run(["pgrep", "-f", str(state)], capture_output=True, text=True)
    assert left.stdout.strip() == "", f"processes left behind: {left.stdout}"
    down = nodus(url, "get", "jobs", check=False)
    assert down.returncode == 1 and "cannot reach the bus" in down.stderr


def test_schema_prints_json_schemas() -> None:
    result = subprocess.run(
        [NODUS, "schema", "Job"], capture_output=True, text=True, timeout=30, check=True
    )
    schema = json.loads(result.stdout)
    assert "$defs" in schema and "Job" in schema["$defs"]
    assert "distributed" in json.dumps(schema["$defs"]["JobSpec"])

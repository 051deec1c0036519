"""Node repair as a user drives it: `nodus up` in the background (remediator and monitor
included), a fault written into a machine's files with `nodus fault inject`, then `nodus get
alerts|recommendations|remediations`, `nodus approve`, `nodus describe remediation`,
`nodus policy`, `nodus repair request` and `nodus breaker` from another shell."""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from libs.bus.server import free_port
from tests.e2e.daemon_logs import DaemonLogs
from tests.e2e.nodus_cli import nodus_on

pytestmark = pytest.mark.slow
FINAL = ("Done", "Failed", "Cancelled")

REPO = Path(__file__).resolve().parents[2]
NODUS = str(Path(sys.executable).parent / "nodus")
FLEET = """
machines:
  - {name: m-a, provider: aws, region: us-east-1, regionClass: us, offering: vm,
     address: 127.0.3.1, pool: pool-a, cluster: c1,
     accelerators: {count: 2, backend: cuda, model: H100}}
  - {name: m-b, provider: aws, region: us-east-1, regionClass: us, offering: vm,
     address: 127.0.3.2, pool: pool-b, cluster: c1,
     accelerators: {count: 2, backend: cuda, model: H100}}
  - {name: m-c, provider: aws, region: us-east-1, regionClass: us, offering: vm,
     address: 127.0.3.3, pool: pool-c, cluster: c2,
     accelerators: {count: 2, backend: cuda, model: H100}}
  - {name: m-d, provider: aws, region: us-east-1, regionClass: us, offering: vm,
     address: 127.0.3.4, pool: pool-d, cluster: c2,
     accelerators: {count: 2, backend: cuda, model: H100}}
"""


def nodus(
    url: str, state: Path, *args: str, check: bool = True
) -> subprocess.CompletedProcess[str]:
    return nodus_on(url, *args, check=check, env={"NODUS_STATE_DIR": str(state)})


def until(check: Callable[[], Any], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.5)
    raise AssertionError(f"{check.__name__} did not hold within {timeout}s")


@contextlib.contextmanager
def nodus_up(state: Path, fleet_text: str, *flags: str) -> Iterator[str]:
    """`nodus up` on a fleet of its own in the background, as an operator runs it; its URL
    once every agent registered; stopped with Ctrl-C afterwards."""
    fleet = state / "fleet.yaml"
    fleet.write_text(fleet_text)
    up = subprocess.Popen(
        [NODUS, "up", "--nats-port", str(free_port()), "--state-dir", str(state),
         "--fleet", str(fleet), *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
    )  # fmt: skip
    assert up.stdout is not None
    line = up.stdout.readline()
    if not line.startswith("NODUS_NATS_URL="):
        up.kill()
        pytest.fail(
            f"nodus up did not become ready: {line!r} {up.stderr.read() if up.stderr else ''}"
        )
    try:
        yield line.strip().split("=", 1)[1]
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=30)


@pytest.fixture(scope="module")
def system(
    tmp_path_factory: pytest.TempPathFactory, daemon_logs: DaemonLogs
) -> Iterator[tuple[str, Path]]:
    state = tmp_path_factory.mktemp("state")
    daemon_logs.watch(state / "logs")
    with nodus_up(state, FLEET, "--detector", "npd") as url:
        yield url, state


def test_a_fault_is_detected_approved_repaired_and_audited(system: tuple[str, Path]) -> None:
    url, state = system
    assert json.loads(nodus(url, state, "get", "alerts", "-o", "json").stdout) == []
    written = nodus(url, state, "fault", "inject", "m-a", "readonly-fs").stdout
    assert "npd.json" in written and "FilesystemIsReadOnly" in written

    def alert() -> list[dict[str, Any]]:
        alerts = json.loads(nodus(url, state, "get", "alerts", "-o", "json").stdout)
        return [a for a in alerts if a["kind"] == "ReadonlyFilesystem" and a["node"] == "m-a"]

    [found] = until(alert)
    assert found["summary"] == "Filesystem remounted read-only (/) on m-a"
    assert found["evidence"][0]["labels"]["reason"] == "FilesystemIsReadOnly"
    assert "Filesystem remounted read-only" in nodus(url, state, "get", "alerts").stdout

    def pending() -> list[dict[str, Any]]:
        rems = json.loads(nodus(url, state, "get", "remediations", "-o", "json").stdout)
        return [r for r in rems if r["state"] == "Pending"]

    [rem] = until(pending)  # after the persistence window; nobody approved it yet
    recs = json.loads(nodus(url, state, "get", "recommendations", "-o", "json").stdout)
    assert [r["action"] for r in recs] == ["Reboot"]
    approved = nodus(url, state, "approve", rem["id"], "--as", "alice").stdout
    assert "Approved" in approved

    def done() -> list[dict[str, Any]]:
        rems = json.loads(nodus(url, state, "get", "remediations", "-o", "json").stdout)
        return [r for r in rems if r["id"] == rem["id"] and r["state"] == "Done"]

    until(done)
    described = nodus(url, state, "describe", "remediation", rem["id"]).stdout
    assert "Approver:     human alice" in described
    assert "Requester:    automatic" in described
    assert "ReadonlyFilesystem -> Reboot" in described
    for state_name in ("Pending", "Approved", "WaitingIdle", "Running", "Revalidating", "Done"):
        assert state_name in described


def test_policy_external_requests_and_the_breaker(system: tuple[str, Path]) -> None:
    url, state = system
    nodus(
        url,
        state,
        "policy",
        "set",
        "--mode",
        "automatic",
        "--trust",
        "reboot",
        "--xid",
        "119=reboot",
    )
    policy = json.loads(nodus(url, state, "policy", "get", "-o", "json").stdout)
    assert policy["mode"] == "Automatic" and policy["trustedActions"] == ["Reboot"]
    assert policy["xidConsent"]["119"]["auto"] == ["Reboot"]
    refused = nodus(url, state, "policy", "set", "--idle-max-wait", "25h", check=False)
    assert refused.returncode == 1 and "24h" in refused.stderr
    delete = nodus(
        url, state, "repair", "request", "--detector", "burn", "--request-id", "r1", "--node", "m-b",
        "--action", "delete", "--line", "GPU 1: FAULTY", check=False,
    )  # fmt: skip
    assert delete.returncode == 1 and "Delete" in delete.stderr
    asked = [
        "repair", "request", "--detector", "burn", "--request-id", "r2", "--node", "m-b",
        "--action", "reboot", "--line", "GPU 1: FAULTY", "--severity", "critical",
    ]  # fmt: skip
    first = nodus(url, state, *asked).stdout
    again = nodus(url, state, *asked).stdout
    assert "created" in first and "exists (same request)" in again
    breakers = nodus(url, state, "breaker", "reset", "c1", "--as", "bob").stdout
    assert "closed by bob" in breakers


def test_node_labels_ask_a_repair_as_the_detector_the_credentials_name(
    system: tuple[str, Path],
) -> None:
    url, state = system
    npd = ["--credentials", str(state / "detectors" / "npd.nk")]

    def m_c_idle() -> bool:
        rems = json.loads(nodus(url, state, "get", "remediations", "-o", "json").stdout)
        return not [r for r in rems if r["node"] == "m-c" and r["state"] not in FINAL]

    until(m_c_idle)
    asked = [
        "label", "node", "m-c", "repair.nodus.io/action=reboot",
        "repair.nodus.io/request-id=npd-7", "repair.nodus.io/evidence=GPU 0: XID 48 DBE", *npd,
    ]  # fmt: skip
    first = nodus(url, state, *asked).stdout
    assert "labeled by npd" in first and "created" in first and "external:npd" in first
    again = nodus(url, state, *asked).stdout
    assert "exists (same request)" in again
    rid = first.split("remediation/", 1)[1].split()[0]
    described = nodus(url, state, "describe", "remediation", rid).stdout
    assert "external:npd (detector npd, request npd-7, by node label)" in described
    listed = nodus(url, state, "label", "node", "m-c").stdout  # the operator reads them
    assert "repair.nodus.io/request-id" in listed and "npd" in listed
    assert rid in listed
    refused = nodus(
        url, state, "label", "node", "m-c", "repair.nodus.io/action=delete",
        "repair.nodus.io/request-id=npd-8", "--overwrite", *npd, check=False,
    )  # fmt: skip
    assert refused.returncode == 1 and "person's decision" in refused.stderr
    other = nodus(
        url, state, "label", "node", "m-c", "team=a", "--detector", "burn", *npd, check=False
    )
    assert other.returncode == 1 and "cannot speak as burn" in other.stderr
    until(m_c_idle)
    person = nodus(
        url, state, "repair", "request", "--node", "m-c", "--action", "reboot", "--as", "carol",
        "--line", "dcgmi diag: GPU 0 FAILED",
    ).stdout  # fmt: skip
    assert "created" in person and "requested by carol" in person

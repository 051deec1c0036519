"""Repairs with real effects in the lab (issue 13, part 5), through `nodus up` and the CLI: a
reboot starts the machine's agent again with a new boot id and keeps its scratch disk; a
reprovision also wipes `STATE_DIR/machines/NAME/scratch` but keeps the machine's identity; a
migration moves it to a new host, and the old host goes to revalidation. Each time the
revalidation asks the agent that came back."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.daemon_logs import DaemonLogs
from tests.e2e.test_remediation_cli import nodus, nodus_up, until

pytestmark = pytest.mark.slow

FLEET = """
machines:
  - {name: r-a, provider: aws, region: us-east-1, regionClass: us, offering: vm,
     address: 127.0.4.1, pool: pool-a, cluster: c1,
     accelerators: {count: 2, backend: cuda, model: H100}}
  - {name: r-b, provider: aws, region: us-east-1, regionClass: us, offering: vm,
     address: 127.0.4.2, pool: pool-b, cluster: c1,
     accelerators: {count: 2, backend: cuda, model: H100}}
  - {name: r-c, provider: aws, region: us-east-1, regionClass: us, offering: vm,
     address: 127.0.4.3, pool: pool-c, cluster: c1,
     accelerators: {count: 2, backend: cuda, model: H100}}
"""


@pytest.fixture(scope="module")
def system(
    tmp_path_factory: pytest.TempPathFactory, daemon_logs: DaemonLogs
) -> Iterator[tuple[str, Path]]:
    state = tmp_path_factory.mktemp("state")
    daemon_logs.watch(state / "logs")
    with nodus_up(state, FLEET) as url:
        yield url, state


def boot_id(url: str, state: Path, node: str) -> str:
    document = json.loads(nodus(url, state, "get", "node", node, "-o", "json").stdout)
    return str((document.get("health") or {}).get("bootId", ""))


def repair(url: str, state: Path, node: str, action: str) -> dict[str, Any]:
    """A person asks; once the node's previous repair let go of it, the new one runs to Done."""
    asked = [
        "repair", "request", "--as", "alice", "--node", node, "--action", action,
        "--line", "dcgmi diag -r 3: GPU 1 memory FAILED", "--severity", "critical", "-o", "json",
    ]  # fmt: skip

    def created() -> dict[str, Any] | None:
        result = nodus(url, state, *asked, check=False)
        return json.loads(result.stdout) if result.returncode == 0 else None

    rem = until(created)

    def done() -> dict[str, Any] | None:
        rems = json.loads(nodus(url, state, "get", "remediations", "-o", "json").stdout)
        found = [r for r in rems if r["id"] == rem["id"] and r["state"] in ("Done", "Failed")]
        return found[0] if found else None

    finished: dict[str, Any] = until(done)
    assert finished["state"] == "Done", finished
    return finished


def local_data(state: Path, node: str, name: str) -> Path:
    """A file a rank left on the machine's local disk (NODUS_SCRATCH_DIR)."""
    scratch = state / "machines" / node / "scratch"
    scratch.mkdir(parents=True, exist_ok=True)
    (scratch / name).write_bytes(b"weights")
    return scratch / name


def restarts(state: Path, node: str) -> int:
    return (
        (state / "logs" / f"agent-{node}.log").read_text().count("restarting: the machine reboots")
    )


# One node each: after a repair a node cools down (R13) before the next one runs.


def test_a_reboot_starts_the_agent_again_and_keeps_local_data(system: tuple[str, Path]) -> None:
    url, state = system
    data = local_data(state, "r-a", "checkpoint.pt")
    before = boot_id(url, state, "r-a")
    assert before
    rebooted = repair(url, state, "r-a", "reboot")
    assert boot_id(url, state, "r-a") not in ("", before)
    assert rebooted["bootIdBefore"] == before
    assert restarts(state, "r-a") == 1
    assert data.read_bytes() == b"weights"
    assert not rebooted.get("diagnostics")  # its files and its agent passed revalidation


def test_a_reprovision_wipes_local_data_and_keeps_the_identity(system: tuple[str, Path]) -> None:
    url, state = system
    data = local_data(state, "r-b", "checkpoint.pt")
    before = boot_id(url, state, "r-b")
    repair(url, state, "r-b", "reprovision")
    assert boot_id(url, state, "r-b") not in ("", before)
    assert restarts(state, "r-b") == 1
    assert not data.exists()  # a clean image: local data is gone
    # its identity stays: the agent that came back connected with it
    assert (state / "machines" / "r-b" / "nats.nk").exists()


def test_a_migration_moves_the_machine_to_a_new_host(system: tuple[str, Path]) -> None:
    url, state = system
    data = local_data(state, "r-c", "again.pt")
    before = boot_id(url, state, "r-c")
    migrated = repair(url, state, "r-c", "migrate")
    assert boot_id(url, state, "r-c") not in ("", before)
    assert migrated["action"] == "Migrate"
    assert migrated["hostAfter"] and migrated["hostAfter"] != migrated["hostBefore"]
    old_host = state / "hosts" / migrated["hostBefore"]
    assert (old_host / "scratch" / "again.pt").exists()  # the data stayed with the old host
    assert not data.exists() and (state / "machines" / "r-c" / "nats.nk").exists()
    described = nodus(url, state, "describe", "remediation", migrated["id"]).stdout
    assert "alice (a person)" in described and migrated["hostAfter"] in described
    # Back in service: every machine is healthy again.
    nodes = json.loads(nodus(url, state, "get", "nodes", "-o", "json").stdout)
    assert {n["inventory"]["node"] for n in nodes if (n["health"] or {}).get("healthy")} == {
        "r-a",
        "r-b",
        "r-c",
    }

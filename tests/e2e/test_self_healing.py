"""Issue 13 as an operator tries it (R17): `nodus up` with three H100 VMs on one VPC (or
three container-only machines, Relayed), the policy automatic for reboots and power cycles, a
2-member Private (or Relayed) gang running the example
all-reduce with checkpoints, then `nodus fault inject MEMBER xid --xid 79` (a GPU that fell
off the bus). The gang runs again in a new epoch on the healthy machines, resumes from its
checkpoint and Succeeds verified; the old epoch was fenced first; the machine is power-cycled,
revalidated and back; `nodus describe job` and `nodus describe remediation` say all of it.
The seconds from the fault to Running again are printed, not judged."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.daemon_logs import DaemonLogs
from tests.e2e.test_remediation_cli import nodus, nodus_up, until

pytestmark = pytest.mark.slow

PRIVATE_FLEET = """
machines:
""" + "".join(
    f"""  - {{name: h-{n}, provider: aws, region: us-east-1, regionClass: us, offering: vm,
     address: 127.0.4.{i}, privateNetwork: use1-vpc, privateAddress: 127.0.5.{i},
     privateInterface: lo, pool: pool-{n}, cluster: c1,
     accelerators: {{count: 8, backend: cuda, model: H100}}}}
"""
    for i, n in enumerate("abc", start=1)
)
# Container-only machines: no network device, no UDP; the gang goes through the relays.
RELAYED_FLEET = """
machines:
""" + "".join(
    f"""  - {{name: c-{n}, provider: vast, region: us-east-2, regionClass: us, offering: container,
     address: 127.0.6.{i}, pool: pool-{n}, cluster: c1,
     accelerators: {{count: 1, backend: cuda, model: L4}}}}
"""
    for i, n in enumerate("abc", start=1)
)

JOB = """
apiVersion: nodus/v1
kind: Job
metadata: {{name: heal, org: acme}}
spec:
  command: [python3, examples/workloads/allreduce.py]
  env: {{ALLREDUCE_MIB: "1", ALLREDUCE_ITERS: "16", ALLREDUCE_STEP_SECONDS: "1"}}
  image: {{libc: glibc}}
  accelerators: {accelerators}
  distributed: {{members: 2, network: {network}, transport: {transport}}}
"""
PATHS = {
    "private": (
        PRIVATE_FLEET,
        JOB.format(
            accelerators="{count: 8, backend: cuda, model: H100}",
            network="Colocated",
            transport="Direct",
        ),
    ),
    "relayed": (
        RELAYED_FLEET,
        JOB.format(accelerators="{count: 1, model: L4}", network="Regional", transport="Auto"),
    ),
}


@pytest.fixture(scope="module", params=sorted(PATHS))
def system(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    daemon_logs: DaemonLogs,
) -> Iterator[tuple[str, Path, str]]:
    state = tmp_path_factory.mktemp("state")
    daemon_logs.watch(state / "logs")
    with nodus_up(state, PATHS[request.param][0]) as url:
        yield url, state, request.param


def _job(url: str, state: Path) -> dict[str, Any]:
    found: dict[str, Any] = json.loads(
        nodus(url, state, "get", "job", "heal", "--org", "acme", "-o", "json").stdout
    )
    return found


def test_a_gpu_off_the_bus_puts_the_gang_back_to_work_on_healthy_machines(
    system: tuple[str, Path, str],
) -> None:
    url, state, path = system
    nodus(url, state, "policy", "set", "--mode", "automatic", "--trust", "reboot,power-cycle")
    spec = state / "heal.yaml"
    spec.write_text(PATHS[path][1])
    nodus(url, state, "apply", "-f", str(spec))

    def running(epoch: int) -> dict[str, Any] | None:
        job = _job(url, state)
        status = job["status"]
        # The JSON leaves out defaults: a Pending job (epoch 0) has no phase (nor epoch).
        phase, current = status.get("phase", "Pending"), status.get("epoch", 0)
        return job if phase == "Running" and current == epoch else None

    first = until(lambda: running(1), timeout=90)
    members = [m["node"] for m in first["status"]["gang"]["members"]]
    assert first["status"]["gang"]["transport"] == path
    time.sleep(4)  # a few steps done, and checkpointed
    victim = members[1]
    fault_time = time.monotonic()
    nodus(url, state, "fault", "inject", victim, "xid", "--xid", "79")
    second = until(lambda: running(2), timeout=120)
    back_to_work = time.monotonic() - fault_time
    print(f"\n{path}: Xid 79 to Running again in epoch 2: {back_to_work:.1f} s")
    assert victim not in {m["node"] for m in second["status"]["gang"]["members"]}
    assert victim in second["status"]["avoid"]

    def ended() -> dict[str, Any] | None:
        job = _job(url, state)
        return job if job["status"].get("phase", "Pending") in ("Succeeded", "Failed") else None

    final = until(ended, timeout=120)
    logs = [nodus(url, state, "logs", "heal", "--org", "acme", "--rank", str(r)).stdout
            for r in range(2)]  # fmt: skip
    assert final["status"]["phase"] == "Succeeded", (final["status"]["conditions"], logs)
    reports = [json.loads(text.strip().splitlines()[-1]) for text in logs]
    assert all(r["verified"] and r["restartCount"] == 1 for r in reports), reports
    assert all(r["resumedAtStep"] > 0 for r in reports), reports  # it resumed, not restarted
    described = nodus(url, state, "describe", "job", "heal", "--org", "acme").stdout
    assert "FaultBrokeMember" in described and "R17" in described
    assert "Xid 79" in described

    def repaired() -> list[dict[str, Any]]:
        rems = json.loads(nodus(url, state, "get", "remediations", "-o", "json").stdout)
        return [r for r in rems if r["node"] == victim and r["state"] == "Done"]

    [rem] = until(repaired, timeout=120)
    assert rem["action"] == "PowerCycle" and rem["breaksWorkload"]
    audit = nodus(url, state, "describe", "remediation", rem["id"]).stdout
    assert "R17" in audit and "Revalidating" in audit

"""Repairs that reach machines (R18) on a real nats-server: the in-band provider (the agent
drains and runs its reboot command), the exec provider (the operator's command, once per
idempotency key even when two remediator replicas race), and revalidation on the machine (its
monitor and its agent must answer)."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from app.lab import faults
from app.lab.provider import LocalProvider
from libs.bus import Bus
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.providers import (
    ExecSettings,
    PoolProvider,
    ProviderKind,
    ProviderOp,
    RemediatorConfig,
)
from libs.contracts.remediation import (
    Action,
    AlertKind,
    Evidence,
    Outcome,
    PersonRepairRequest,
    Policy,
    RebootRequest,
    RemediationReply,
    RemediationState,
)
from services.remediator.main import BUCKETS
from services.remediator.provider import MachineProvider, ProviderError
from services.remediator.providers.router import PoolProviders
from tests.integration.remediation_fixtures import fleet_fixture  # noqa: F401  (the `fleet` fixture)
from tests.remediation_support import Fleet


def recorder(path: Path) -> list[str]:
    """A reboot command that records that it ran."""
    return [sys.executable, "-c", f"open({str(path)!r}, 'a').write('rebooted\\n')"]


def providers(fleet: Fleet, config: RemediatorConfig) -> Callable[[Bus, str], MachineProvider]:
    def build(bus: Bus, replica: str) -> MachineProvider:
        return PoolProviders(
            bus, config, fleet.state_dir, replica, fleet.clock, 5.0, lab=LocalProvider
        )

    return build


INBAND = RemediatorConfig(providers={"h100": PoolProvider(kind=ProviderKind.INBAND)})


async def boots(fleet: Fleet, node: str) -> None:
    """The host comes back: a new boot (the lab's files start over, the agent's boot id)."""
    faults.reboot(fleet.machine_dir(node))
    await fleet.agents[node].reboot(RebootRequest(op_id="boot"))  # in-process: a new boot id


async def until_file(path: Path, timeout: float = 20.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not await asyncio.to_thread(path.exists):
        assert asyncio.get_running_loop().time() < deadline, f"{path} never appeared"
        await asyncio.sleep(0.05)


async def test_inband_reboot_drains_reboots_and_revalidates_on_the_machine(
    fleet: Fleet, tmp_path: Path
) -> None:
    rebooted = tmp_path / "rebooted"
    await fleet.add_machines(
        ["gpu-a"],
        agent_options={"host_reboot": True, "reboot_command": recorder(rebooted)},
        pool="h100",
        cluster="c1",
    )
    await fleet.serve_diagnostics()
    await fleet.set_policy(Policy(mode="Automatic", trusted_actions=[Action.REBOOT]))
    await fleet.start_remediator("r1", provider=providers(fleet, INBAND))
    fleet.inject("gpu-a", "readonly-fs")
    await fleet.until(lambda: _has_alert(fleet))
    fleet.clock.advance(seconds=61)
    await until_file(rebooted)  # the agent ran its reboot command
    running = await fleet.remediation_in("gpu-a", RemediationState.RUNNING)
    await boots(fleet, "gpu-a")
    done = await fleet.remediation_in("gpu-a", RemediationState.DONE, timeout=20)
    assert "drained 0 ranks and rebooted its host" in done.provider_answer
    assert done.diagnostics == [] and done.outcome is Outcome.DONE
    assert rebooted.read_text() == "rebooted\n"
    op = await fleet.bus.bucket(names.BUCKET_PROVIDER_OPS, ProviderOp).get(running.op_id)
    assert op is not None and (op.value.state, op.value.provider) == ("Done", ProviderKind.INBAND)


async def _has_alert(fleet: Fleet) -> bool:
    return bool(await fleet.alerts())


async def test_an_agent_without_host_reboot_fails_the_step_with_its_reason(fleet: Fleet) -> None:
    await fleet.add_machines(["gpu-a"], pool="h100", cluster="c1")
    await fleet.set_policy(Policy(mode="Automatic", trusted_actions=[Action.REBOOT]))
    await fleet.start_remediator("r1", provider=providers(fleet, INBAND))
    fleet.inject("gpu-a", "readonly-fs")
    await fleet.until(lambda: _has_alert(fleet))
    fleet.clock.advance(seconds=61)
    failed = await fleet.remediation_in("gpu-a", RemediationState.FAILED)
    assert "in-band reboot is off on gpu-a's agent (start it with --host-reboot)" in failed.reason


async def test_revalidation_fails_when_the_machine_does_not_answer(
    fleet: Fleet, tmp_path: Path
) -> None:
    """No monitor answers for the machine: it cannot say it is healthy, so it does not rejoin."""
    rebooted = tmp_path / "rebooted"
    await fleet.add_machines(
        ["gpu-a"],
        agent_options={"host_reboot": True, "reboot_command": recorder(rebooted)},
        pool="h100",
        cluster="c1",
    )
    await fleet.set_policy(Policy(mode="Automatic", trusted_actions=[Action.REBOOT]))
    await fleet.start_remediator("r1", provider=providers(fleet, INBAND))
    fleet.inject("gpu-a", "readonly-fs")
    await fleet.until(lambda: _has_alert(fleet))
    fleet.clock.advance(seconds=61)
    await until_file(rebooted)
    await fleet.remediation_in("gpu-a", RemediationState.RUNNING)
    await boots(fleet, "gpu-a")
    failed = await fleet.remediation_in("gpu-a", RemediationState.FAILED, timeout=20)
    assert any(
        "gpu-a's monitor does not answer its diagnose request" in d for d in failed.diagnostics
    )


# -- exec ----------------------------------------------------------------------------------------

SCRIPT = """
import json, os, sys, time
request = json.load(sys.stdin)
key = os.environ["NODUS_IDEMPOTENCY_KEY"]
with open(sys.argv[1], "a") as log:
    log.write(json.dumps({"key": key, "request": request}) + "\\n")
time.sleep(float(sys.argv[2]))
print(json.dumps({"message": "reimaged " + request["node"]}))
"""


def exec_config(
    tmp_path: Path, log: Path, seconds: float = 0.5, **settings: object
) -> RemediatorConfig:
    script = tmp_path / "reprovision.py"
    script.write_text(SCRIPT)
    command = [sys.executable, str(script), str(log), str(seconds)]
    return RemediatorConfig(
        providers={
            "h100": PoolProvider(
                kind=ProviderKind.EXEC,
                exec=ExecSettings(commands={Action.REPROVISION: command}, **settings),  # type: ignore[arg-type]
            )
        }
    )


async def test_two_replicas_racing_run_the_operators_command_once(
    fleet: Fleet, tmp_path: Path
) -> None:
    log = tmp_path / "runs.jsonl"
    config = exec_config(tmp_path, log)
    await fleet.add_machines(["gpu-a"], pool="h100", cluster="c1")
    buses = [await Bus.open(fleet.url, name=f"r{i}", buckets=BUCKETS) for i in (1, 2)]
    try:
        replicas = [providers(fleet, config)(bus, f"r{i}") for i, bus in enumerate(buses, 1)]

        async def until_answer(provider: MachineProvider) -> tuple[str | None, list[str]]:
            waits: list[str] = []
            while True:
                try:
                    return await provider.execute("gpu-a", Action.REPROVISION, "x1.op"), waits
                except ProviderError as error:
                    assert not error.permanent, error.reason
                    waits.append(error.reason)
                    await asyncio.sleep(0.05)

        answers = await asyncio.gather(*(until_answer(p) for p in replicas))
        [line] = log.read_text().splitlines()  # exactly one run
        run = json.loads(line)
        assert run["key"] == "x1.op"
        assert (run["request"]["node"], run["request"]["action"]) == ("gpu-a", "Reprovision")
        assert run["request"]["idempotencyKey"] == "x1.op"
        said = {answer for answer, _ in answers}
        assert len(said) == 1 and "reimaged gpu-a" in said.pop()  # type: ignore[operator]
        waited = [w for _, waits in answers for w in waits]
        assert waited and all("runs the operator's Reprovision command" in w for w in waited)
        # later calls (a replica restarted) read the recorded answer
        assert await replicas[1].executed("gpu-a", "x1.op")
        await replicas[0].execute("gpu-a", Action.REPROVISION, "x1.op")
        assert len(log.read_text().splitlines()) == 1
        op = await fleet.bus.bucket(names.BUCKET_PROVIDER_OPS, ProviderOp).get("x1.op")
        assert op is not None and op.value.exit_code == 0 and "reimaged" in op.value.stdout
    finally:
        for bus in buses:
            await bus.close()


def _evidence() -> Evidence:
    return Evidence(
        kind=AlertKind.EXTERNAL,
        source="person:alice",
        node="gpu-a",
        where="dcgmi diag -r 3",
        observed_time=now(),
        severity="critical",
        lines=["Diagnostic: GPU 2 memory test FAILED"],
    )


@pytest.mark.slow
async def test_a_reprovision_through_two_replicas_runs_the_script_once(
    fleet: Fleet, tmp_path: Path
) -> None:
    log = tmp_path / "runs.jsonl"
    config = exec_config(tmp_path, log, seconds=1.0)
    # two machines: a person's repair keeps half the cluster in service
    await fleet.add_machines(["gpu-a", "gpu-b"], pool="h100", cluster="c1")
    await fleet.serve_diagnostics()
    for replica in ("r1", "r2"):
        await fleet.start_remediator(replica, provider=providers(fleet, config))
    reply = await fleet.bus.request(
        names.API_REMEDIATION_REQUEST,
        PersonRepairRequest(
            by="alice",
            request_id="p1",
            node="gpu-a",
            action=Action.REPROVISION,
            evidence=[_evidence()],
        ),
        RemediationReply,
    )
    await until_file(log)
    await fleet.remediation_in("gpu-a", RemediationState.RUNNING)
    # the operator's reimage boots the machine
    await asyncio.sleep(1.2)
    await boots(fleet, "gpu-a")
    done = await fleet.remediation_in("gpu-a", RemediationState.DONE, timeout=20)
    assert done.id == reply.remediation.id
    assert "exited 0: reimaged gpu-a" in done.provider_answer
    [line] = log.read_text().splitlines()
    request = json.loads(line)["request"]
    assert request["remediationId"] == done.id and request["requester"] == "human:alice"
    assert request["evidence"] == [
        "External from person:alice at dcgmi diag -r 3: Diagnostic: GPU 2 memory test FAILED"
    ]


async def test_a_failing_or_hanging_command_fails_the_step_with_its_answer(
    fleet: Fleet, tmp_path: Path
) -> None:
    await fleet.add_machines(["gpu-a"], pool="h100", cluster="c1")
    failing = RemediatorConfig(
        providers={
            "h100": PoolProvider(
                kind=ProviderKind.EXEC,
                exec=ExecSettings(
                    commands={
                        Action.REPROVISION: [
                            sys.executable,
                            "-c",
                            "import sys; print('working'); sys.exit('no PXE server answers')",
                        ],
                        Action.MIGRATE: [sys.executable, "-c", "import time; time.sleep(30)"],
                    },
                    timeout_seconds=0.5,
                ),
            )
        }
    )
    provider = providers(fleet, failing)(fleet.bus, "r1")
    with pytest.raises(ProviderError) as failed:
        await provider.execute("gpu-a", Action.REPROVISION, "f1.op")
    assert (
        failed.value.permanent
        and "exited 1 for Reprovision of gpu-a: no PXE server answers" in failed.value.reason
    )
    op = await fleet.bus.bucket(names.BUCKET_PROVIDER_OPS, ProviderOp).get("f1.op")
    assert op is not None and op.value.state == "Failed"
    assert (op.value.exit_code, op.value.stdout.strip()) == (1, "working")
    assert "no PXE server answers" in op.value.stderr_tail
    with pytest.raises(ProviderError, match="no PXE server answers"):  # recorded; never run again
        await provider.execute("gpu-a", Action.REPROVISION, "f1.op")
    with pytest.raises(ProviderError, match=r"did not finish within 0.5 s \(killed\)"):
        await provider.execute("gpu-a", Action.MIGRATE, "f2.op")
    with pytest.raises(ProviderError, match="exec has no command for Delete"):
        await provider.execute("gpu-a", Action.DELETE, "f3.op")

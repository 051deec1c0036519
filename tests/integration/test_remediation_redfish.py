"""The Redfish provider against a real Redfish HTTP server (sushy-tools' emulator, R12, R18):
an Xid 79 on a machine whose pool uses Redfish power-cycles its system (seen through the
emulator's own API: PowerState On -> Off -> On and its reset actions), and the repair
completes when the agent comes back with a new boot id; a BMC that refuses or does not answer
fails the step with its reason; a reprovision sets a one-time network boot and restarts."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from app.lab import faults
from app.lab.provider import LocalProvider
from libs.bus import Bus
from libs.contracts import names
from libs.contracts.providers import (
    Bmc,
    PoolProvider,
    ProviderKind,
    ProviderOp,
    RedfishSettings,
    RemediatorConfig,
)
from libs.contracts.remediation import Action, Outcome, Policy, RebootRequest, RemediationState
from libs.runtime.tasks import cancel_and_wait
from services.remediator.provider import MachineProvider, ProviderError
from services.remediator.providers.router import PoolProviders
from tests.integration.redfish_emulator import Emulator, emulator_fixture  # noqa: F401
from tests.integration.remediation_fixtures import fleet_fixture  # noqa: F401  (the `fleet` fixture)
from tests.remediation_support import Fleet


def redfish(
    emulator: Emulator, credentials: Path | None = None, **settings: object
) -> RemediatorConfig:
    bmcs: dict[str, Bmc | str] = {
        node: Bmc(address=emulator.url, system=emulator.system_path(node))
        for node in emulator.systems
    }
    options: dict[str, object] = {
        "verify_tls": False,
        "timeout_seconds": 5.0,
        "power_timeout_seconds": 60.0,
        "off_seconds": 0.5,
        **settings,
    }
    return RemediatorConfig(
        providers={
            "bmc": PoolProvider(
                kind=ProviderKind.REDFISH,
                redfish=RedfishSettings(
                    credentials_file=str(credentials or emulator.credentials_file),
                    bmcs=bmcs,
                    **options,  # type: ignore[arg-type]
                ),
            )
        }
    )


def providers(fleet: Fleet, config: RemediatorConfig) -> Callable[[Bus, str], MachineProvider]:
    def build(bus: Bus, replica: str) -> MachineProvider:
        return PoolProviders(
            bus, config, fleet.state_dir, replica, fleet.clock, 5.0, lab=LocalProvider
        )

    return build


class PowerWatch:
    """Polls the system's PowerState through the emulator's API; when it turns On again after
    Off, the machine boots (its lab files start over, its agent gets a new boot id)."""

    def __init__(self, fleet: Fleet, emulator: Emulator, node: str) -> None:
        self.fleet, self.emulator, self.node = fleet, emulator, node
        self.states: list[str] = []
        self.task = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        while True:
            system = await asyncio.to_thread(self.emulator.system, self.node)
            state = system["PowerState"]
            if not self.states or self.states[-1] != state:
                self.states.append(state)
                if state == "On" and "Off" in self.states:
                    faults.reboot(self.fleet.machine_dir(self.node))
                    await self.fleet.agents[self.node].reboot(RebootRequest(op_id="power-on"))
            await asyncio.sleep(0.2)

    async def stop(self) -> None:
        await cancel_and_wait([self.task])


async def _alerted(fleet: Fleet) -> bool:
    return bool(await fleet.alerts())


@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_xid_79_power_cycles_the_system_through_its_bmc(
    fleet: Fleet, emulator: Emulator
) -> None:
    await fleet.add_machines(["gpu-a", "gpu-b"], pool="bmc", cluster="c1")
    await fleet.serve_diagnostics()
    await fleet.set_policy(Policy(mode="Automatic", trusted_actions=[Action.POWER_CYCLE]))
    await fleet.start_remediator("r1", provider=providers(fleet, redfish(emulator)))
    watch = PowerWatch(fleet, emulator, "gpu-a")
    try:
        boot_before = fleet.agents["gpu-a"].boot_id
        fleet.inject("gpu-a", "xid", xid=79)
        await fleet.until(lambda: _alerted(fleet))
        fleet.clock.advance(seconds=61)
        done = await fleet.remediation_in(
            "gpu-a", RemediationState.DONE, RemediationState.FAILED, timeout=90
        )
    finally:
        await watch.stop()
    assert done.outcome is Outcome.DONE, done.reason
    assert done.action is Action.POWER_CYCLE
    assert watch.states == ["On", "Off", "On"]  # the BMC cut the power and restored it
    assert emulator.resets("gpu-a") == 2 and emulator.resets("gpu-b") == 0  # ForceOff, On
    assert "ForceOff, Off after" in done.provider_answer and "On after" in done.provider_answer
    assert done.boot_id_before == boot_before != fleet.agents["gpu-a"].boot_id
    assert done.diagnostics == []  # revalidated on the machine after the boot
    op = await fleet.bus.bucket(names.BUCKET_PROVIDER_OPS, ProviderOp).get(done.op_id)
    assert op is not None and op.value.steps == ["off", "on"] and op.value.state == "Done"


async def test_a_bmc_that_refuses_fails_the_step_with_its_reason(
    fleet: Fleet, emulator: Emulator, tmp_path: Path
) -> None:
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("username: nodus\npassword: not-the-password\n")
    await fleet.add_machines(["gpu-a", "gpu-b"], pool="bmc", cluster="c1")
    await fleet.set_policy(Policy(mode="Automatic", trusted_actions=[Action.REBOOT]))
    await fleet.start_remediator("r1", provider=providers(fleet, redfish(emulator, wrong)))
    fleet.inject("gpu-a", "readonly-fs")
    await fleet.until(lambda: _alerted(fleet))
    fleet.clock.advance(seconds=61)
    failed = await fleet.remediation_in("gpu-a", RemediationState.FAILED, timeout=20)
    assert f"BMC {emulator.url} refused" in failed.reason and "HTTP 401" in failed.reason
    assert "HTTP 401" in failed.provider_answer
    assert "not-the-password" not in failed.reason
    assert emulator.resets("gpu-a") == 0


async def test_a_bmc_that_does_not_answer_fails_the_step(fleet: Fleet, tmp_path: Path) -> None:
    hung: list[asyncio.StreamWriter] = []

    async def never_answer(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hung.append(writer)  # accepts, reads nothing, says nothing

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    credentials = tmp_path / "bmc.yaml"
    credentials.write_text("username: u\npassword: p\n")
    config = RemediatorConfig(
        providers={
            "bmc": PoolProvider(
                kind=ProviderKind.REDFISH,
                redfish=RedfishSettings(
                    credentials_file=str(credentials),
                    address_template=f"http://127.0.0.1:{port}/{{node}}",
                    timeout_seconds=1.0,
                ),
            )
        }
    )
    await fleet.add_machines(["gpu-a"], pool="bmc", cluster="c1")
    provider = providers(fleet, config)(fleet.bus, "r1")
    try:
        with pytest.raises(ProviderError) as failed:
            await provider.execute("gpu-a", Action.POWER_CYCLE, "t1.op")
    finally:
        server.close()
        for writer in hung:
            writer.close()
    assert failed.value.permanent
    assert f"BMC http://127.0.0.1:{port}/gpu-a did not answer" in failed.value.reason
    assert "timeout 1 s" in failed.value.reason
    op = await fleet.bus.bucket(names.BUCKET_PROVIDER_OPS, ProviderOp).get("t1.op")
    assert op is not None and op.value.state == "Failed" and "did not answer" in op.value.answer


async def test_a_reprovision_boots_once_from_the_network(fleet: Fleet, emulator: Emulator) -> None:
    await fleet.add_machines(["gpu-a"], pool="bmc", cluster="c1")
    provider = providers(fleet, redfish(emulator))(fleet.bus, "r1")
    answer = await provider.execute("gpu-a", Action.REPROVISION, "p1.op")
    assert answer is not None and "boot source override Pxe once" in answer
    system = await asyncio.to_thread(emulator.system, "gpu-a")
    assert system["Boot"]["BootSourceOverrideTarget"] == "Pxe"
    assert emulator.resets("gpu-a") == 1  # the restart into the installer
    # the same op again: recorded as done, nothing sent to the BMC
    assert await provider.executed("gpu-a", "p1.op")
    assert await provider.execute("gpu-a", Action.REPROVISION, "p1.op") is None
    assert emulator.resets("gpu-a") == 1

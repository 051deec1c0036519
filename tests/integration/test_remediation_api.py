"""The remediator's API on a real nats-server: repair requests from external detectors
(R8), cancellations, and cordons placed by someone else."""

from __future__ import annotations

import msgspec
import pytest

from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.epochs import Lease
from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.remediation import (
    Action,
    AlertKind,
    CancelRequest,
    Cordon,
    CordonHold,
    Evidence,
    Policy,
    RemediationReply,
    RemediationState,
    RepairRequest,
)
from tests.integration.remediation_fixtures import (
    fleet_fixture,  # noqa: F401  (the `fleet` fixture)
    has_alerts,
)
from tests.remediation_support import Fleet

# -- R8: external detectors ---------------------------------------------------------------------

GPU_BURN = names.caller_subject(names.API_REMEDIATION_EXTERNAL, "gpu-burn")


def external(
    node: str, request_id: str = "req-1", action: Action = Action.REBOOT, **kw: object
) -> RepairRequest:
    evidence = Evidence(
        kind=AlertKind.EXTERNAL,
        source="external:gpu-burn",
        node=node,
        where="gpu-burn --check",
        observed_time=now(),
        severity="critical",
        lines=["GPU 3: FAULTY (errors: 12)"],
    )
    fields: dict[str, object] = {
        "detector": "gpu-burn",
        "request_id": request_id,
        "node": node,
        "action": action,
        "evidence": [evidence],
    }
    fields.update(kw)
    return RepairRequest(**fields)  # type: ignore[arg-type]


async def test_external_requests(fleet: Fleet) -> None:
    await fleet.add_machines(["gpu-a", "gpu-b", "gpu-c", "gpu-d"], pool="h100", cluster="c1")
    await fleet.start_remediator()
    bus = fleet.bus

    async def ask(request: RepairRequest) -> RemediationReply:
        return await bus.request(GPU_BURN, request, RemediationReply)

    first = await ask(external("gpu-a"))
    assert first.created and first.remediation.requester.kind == "external"
    assert first.remediation.requester.detector == "gpu-burn"
    assert first.remediation.requester.request_id == "req-1"
    assert first.remediation.approver is not None and "R8" in first.remediation.approver.rule
    again = await ask(external("gpu-a"))  # the same (detector, request id): one repair
    assert not again.created and again.remediation.id == first.remediation.id
    for refused, code in [
        (external("gpu-b", "r2", Action.DELETE), ErrorCode.INVALID),
        (external("gpu-b", "r3", evidence=[]), ErrorCode.INVALID),
        (
            external(
                "gpu-b",
                "r4",
                evidence=[
                    Evidence(
                        kind=AlertKind.NODE_NOT_READY,
                        source="external:x",
                        node="gpu-b",
                        where="k8s",
                        observed_time=now(),
                        lines=["NotReady"],
                    )
                ],
            ),
            ErrorCode.INVALID,
        ),
        (
            external(
                "gpu-b", "r5", evidence=[msgspec.structs.replace(external("gpu-c").evidence[0])]
            ),
            ErrorCode.INVALID,
        ),
        (external("gpu-z", "r6"), ErrorCode.NOT_FOUND),
        (external("gpu-b", "r9", detector="npd"), ErrorCode.INVALID),  # speaks as another
        (external("gpu-a", "r7"), ErrorCode.CONFLICT),  # gpu-a is being repaired
    ]:
        with pytest.raises(NodusError) as caught:
            await ask(refused)
        assert caught.value.code is code, refused
    # skips approval: it runs without anyone approving it
    done = await fleet.remediation_in("gpu-a", RemediationState.DONE)
    assert done.id == first.remediation.id
    assert [(n, a) for n, a, _ in fleet.executed] == [("gpu-a", Action.REBOOT)]
    # R11 for externals: migrate with warning evidence only runs as reprovision
    warned = external("gpu-b", "r8", Action.MIGRATE)
    warned = msgspec.structs.replace(
        warned, evidence=[msgspec.structs.replace(warned.evidence[0], severity="warning")]
    )
    migrated = await ask(warned)
    assert migrated.remediation.action is Action.REPROVISION


async def test_external_cap_and_capacity(fleet: Fleet) -> None:
    await fleet.add_machines([f"gpu-{i}" for i in range(10)], pool="h100", cluster="c1")
    from services.remediator.guardrails import Settings

    await fleet.start_remediator(settings=Settings(external_cap=2, min_available_fraction=0.5))
    leases = fleet.bus.bucket(names.BUCKET_LEASES, Lease)
    for i in range(10):  # busy nodes: the repairs wait, so they stay active
        await leases.put(f"gpu-{i}", Lease(gang=f"o.j{i}", epoch=1, placer="p", created_time=now()))

    async def ask(request: RepairRequest) -> RemediationReply:
        return await fleet.bus.request(GPU_BURN, request, RemediationReply)

    await ask(external("gpu-0", "a"))
    await ask(external("gpu-1", "b"))
    with pytest.raises(NodusError) as caught:
        await ask(external("gpu-2", "c"))
    assert caught.value.code is ErrorCode.CONFLICT and "cap" in caught.value.message
    # a person cordoned half the cluster: the capacity check refuses more
    cordons = fleet.bus.bucket(names.BUCKET_CORDONS, Cordon)
    for i in range(5, 10):
        await cordons.put(
            f"gpu-{i}",
            Cordon(
                node=f"gpu-{i}", holds={"bob": CordonHold(by="bob", reason="maint", time=now())}
            ),
        )
    await fleet.bus.request(
        names.API_REMEDIATION_CANCEL,
        CancelRequest(id=(await fleet.remediations("gpu-1"))[0].id, by="bob"),
        RemediationReply,
    )

    async def seen() -> bool:
        return all(
            n in fleet.remediators[0][0].store.cordons for n in (f"gpu-{i}" for i in range(5, 10))
        )

    await fleet.until(seen, scan=False)
    with pytest.raises(NodusError) as caught:
        await ask(external("gpu-3", "d"))
    assert caught.value.code is ErrorCode.CONFLICT and "capacity" in caught.value.message


# -- cancel, and cordons of others --------------------------------------------------------------


async def test_cancel_and_a_cordon_placed_by_someone_else_stays(fleet: Fleet) -> None:
    await fleet.add_machines(["gpu-a"], pool="h100", cluster="c1")
    await fleet.set_policy(Policy(mode="Automatic", trusted_actions=[Action.REBOOT]))
    cordons = fleet.bus.bucket(names.BUCKET_CORDONS, Cordon)
    await cordons.put(
        "gpu-a",
        Cordon(node="gpu-a", holds={"bob": CordonHold(by="bob", reason="maintenance", time=now())}),
    )
    await fleet.start_remediator()
    fleet.inject("gpu-a", "readonly-fs")
    await fleet.until(lambda: has_alerts(fleet, 1))
    fleet.clock.advance(seconds=61)
    await fleet.remediation_in("gpu-a", RemediationState.DONE)

    async def only_bob() -> bool:
        found = await cordons.get("gpu-a")
        return found is not None and set(found.value.holds) == {"bob"}

    await fleet.until(only_bob)
    # a repair waiting for idle can be cancelled; a running one cannot
    leases = fleet.bus.bucket(names.BUCKET_LEASES, Lease)
    await leases.put("gpu-a", Lease(gang="acme.train", epoch=1, placer="p", created_time=now()))
    fleet.inject("gpu-a", "row-remap-pending")  # it waits for idle (R17's faults do not)
    fleet.clock.advance(minutes=40)
    waiting = await fleet.remediation_in("gpu-a", RemediationState.WAITING_IDLE)
    reply = await fleet.bus.request(
        names.API_REMEDIATION_CANCEL,
        CancelRequest(id=waiting.id, by="carol", reason="not now"),
        RemediationReply,
    )
    assert reply.remediation.state is RemediationState.CANCELLED
    assert reply.remediation.history[-1].by == "carol"
    await fleet.until(only_bob)

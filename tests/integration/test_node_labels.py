"""Repairs asked through node labels (R8), and by a person, on a real nats-server with the
detector's own confined bus user: the detector is named by its credentials, the same request set
twice makes one repair, Delete is refused with a reason, and a detector cannot pass for another
detector or for a person."""

from __future__ import annotations

import pytest

from libs.bus import Bus
from libs.bus.auth import DETECTOR, DETECTOR_INBOX, detector_of
from libs.bus.server import NatsServer
from libs.contracts import names
from libs.contracts.base import now
from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.remediation import (
    LABEL_ACTION,
    LABEL_EVIDENCE,
    LABEL_REMEDIATION,
    LABEL_REQUEST_ID,
    Action,
    AlertKind,
    Evidence,
    LabelReply,
    LabelRequest,
    NodeLabels,
    PersonRepairRequest,
    RemediationReply,
    RemediationState,
    RepairRequest,
)
from tests.integration.remediation_fixtures import fleet_fixture  # noqa: F401
from tests.remediation_support import Fleet

REPAIR = {
    LABEL_ACTION: "reboot",
    LABEL_REQUEST_ID: "npd-0001",
    LABEL_EVIDENCE: "NVRM: Xid (PCI:0000:3b:00): 48, pid=1, DBE (0x1,0x2)",
}


async def detector_bus(server: NatsServer, name: str) -> Bus:
    seed = server.user(f"detector-{name}", DETECTOR, name)
    return await Bus.open(
        server.url, name=f"detector-{name}", credentials=seed, inbox_prefix=DETECTOR_INBOX
    )


async def label(bus: Bus, caller: str, node: str, **changes: object) -> LabelReply:
    request = LabelRequest(node=node, **changes)  # type: ignore[arg-type]
    return await bus.request(
        names.caller_subject(names.API_NODE_LABEL, caller), request, LabelReply, timeout=5.0
    )


async def test_a_detector_asks_a_repair_by_label_once(
    fleet: Fleet, nats_server: NatsServer
) -> None:
    await fleet.add_machines(["gpu-a", "gpu-b", "gpu-c"], pool="h100", cluster="c1")
    await fleet.start_remediator()
    npd = await detector_bus(nats_server, "npd")
    try:
        # The server names the detector: that is whom its requests are from.
        assert detector_of(await npd.user_info()) == "npd"
        first = await label(npd, "npd", "gpu-a", set=REPAIR)
        assert first.created and first.remediation is not None
        rem = first.remediation
        assert (rem.requester.kind, rem.requester.name) == ("external", "external:npd")
        assert (rem.requester.detector, rem.requester.request_id) == ("npd", "npd-0001")
        assert rem.requester.via == "label" and "by node label" in rem.rule
        assert rem.evidence[0].lines == [REPAIR[LABEL_EVIDENCE]]
        assert rem.action is Action.REBOOT and rem.state is RemediationState.APPROVED
        # The node keeps the labels, who set them, and the repair they made.
        stored = await fleet.bus.bucket(names.BUCKET_NODE_LABELS, NodeLabels).get("gpu-a")
        assert stored is not None
        assert {k: v.by for k, v in stored.value.labels.items()} == {
            **{k: "npd" for k in REPAIR},
            LABEL_REMEDIATION: "nodus",
        }
        assert stored.value.labels[LABEL_REMEDIATION].value == rem.id

        # Set twice, and asked again through the API with the same id: one repair.
        again = await label(npd, "npd", "gpu-a", set=REPAIR)
        assert not again.created and again.remediation is not None
        assert again.remediation.id == rem.id
        through_api = await npd.request(
            names.caller_subject(names.API_REMEDIATION_EXTERNAL, "npd"),
            RepairRequest(
                request_id="npd-0001",
                node="gpu-a",
                action=Action.REBOOT,
                evidence=rem.evidence,
            ),
            RemediationReply,
        )
        assert not through_api.created and through_api.remediation.id == rem.id
        done = await fleet.remediation_in("gpu-a", RemediationState.DONE)
        assert done.id == rem.id
        assert [(n, a) for n, a, _ in fleet.executed] == [("gpu-a", Action.REBOOT)]
        assert len(await fleet.remediations("gpu-a")) == 1

        # Delete by label is refused with its reason; the labels stay as they were.
        with pytest.raises(NodusError) as caught:
            await label(
                npd, "npd", "gpu-b", set={**REPAIR, LABEL_ACTION: "delete", LABEL_REQUEST_ID: "x2"}
            )
        assert caught.value.code is ErrorCode.INVALID
        assert "person's decision" in caught.value.message
        assert await fleet.bus.bucket(names.BUCKET_NODE_LABELS, NodeLabels).get("gpu-b") is None
        assert await fleet.remediations("gpu-b") == []
        # No evidence, no repair (R3); a label of Nodus's own cannot be set; bad keys are named.
        for changes, code, words in [
            ({LABEL_ACTION: "reboot", LABEL_REQUEST_ID: "x3"}, ErrorCode.INVALID, "R3"),
            ({LABEL_REMEDIATION: "gpu-b.0"}, ErrorCode.INVALID, "Nodus's own"),
            ({"bad key!": "v"}, ErrorCode.INVALID, "label key"),
        ]:
            with pytest.raises(NodusError) as caught:
                await label(npd, "npd", "gpu-b", set=changes)
            assert caught.value.code is code and words in caught.value.message
        # Other labels are labels: they ask nothing; changing one needs overwrite.
        await label(npd, "npd", "gpu-b", set={"team": "vision"})
        with pytest.raises(NodusError) as caught:
            await label(npd, "npd", "gpu-b", set={"team": "nlp"})
        assert caught.value.code is ErrorCode.CONFLICT and "overwrite" in caught.value.message
        changed = await label(npd, "npd", "gpu-b", set={"team": "nlp"}, overwrite=True)
        assert changed.labels.labels["team"].value == "nlp" and changed.remediation is None
        removed = await label(npd, "npd", "gpu-b", remove=["team"])
        assert removed.labels.labels == {}
    finally:
        await npd.close()


async def test_a_detector_speaks_only_as_itself(fleet: Fleet, nats_server: NatsServer) -> None:
    await fleet.add_machines(["gpu-a", "gpu-b"], pool="h100", cluster="c1")
    await fleet.start_remediator()
    npd = await detector_bus(nats_server, "npd")
    try:
        # The bus refuses its publish as another detector, and as a person.
        with pytest.raises(NodusError) as caught:
            await label(npd, "gpu-burn", "gpu-a", set=REPAIR)
        assert caught.value.code is ErrorCode.UNAUTHORIZED
        with pytest.raises(NodusError) as caught:
            await npd.request(
                names.API_REMEDIATION_REQUEST,
                PersonRepairRequest(
                    by="alice", request_id="r1", node="gpu-a", action=Action.DELETE
                ),
                RemediationReply,
                timeout=2.0,
            )
        assert caught.value.code is ErrorCode.UNAUTHORIZED
        # Its body cannot name another detector either.
        with pytest.raises(NodusError) as caught:
            await npd.request(
                names.caller_subject(names.API_REMEDIATION_EXTERNAL, "npd"),
                RepairRequest(
                    request_id="r2",
                    node="gpu-a",
                    action=Action.REBOOT,
                    detector="gpu-burn",
                    evidence=[evidence("gpu-a")],
                ),
                RemediationReply,
            )
        assert caught.value.code is ErrorCode.INVALID and "only as itself" in caught.value.message
        assert await fleet.remediations() == []
    finally:
        await npd.close()


def evidence(node: str) -> Evidence:
    return Evidence(
        kind=AlertKind.EXTERNAL,
        source="person:alice",
        node=node,
        where="dcgmi diag -r 3",
        observed_time=now(),
        severity="critical",
        lines=["Diagnostic: GPU 2 memory test FAILED"],
    )


async def test_a_person_asks_a_repair_as_a_person(fleet: Fleet) -> None:
    await fleet.add_machines(["gpu-a", "gpu-b", "gpu-c"], pool="h100", cluster="c1")
    await fleet.start_remediator()

    async def ask(request: PersonRepairRequest) -> RemediationReply:
        return await fleet.bus.request(names.API_REMEDIATION_REQUEST, request, RemediationReply)

    # No failed check on the node and none given: refused (R3).
    with pytest.raises(NodusError) as caught:
        await ask(
            PersonRepairRequest(by="alice", request_id="a1", node="gpu-a", action=Action.REBOOT)
        )
    assert caught.value.code is ErrorCode.INVALID and "R3" in caught.value.message
    # With the check's lines: recorded as the person, who approved it by asking; Delete too.
    reply = await ask(
        PersonRepairRequest(
            by="alice",
            request_id="a2",
            node="gpu-a",
            action=Action.DELETE,
            evidence=[evidence("gpu-a")],
            reason="RMA",
        )
    )
    rem = reply.remediation
    assert reply.created and rem.action is Action.DELETE
    assert (rem.requester.kind, rem.requester.name) == ("human", "alice")
    assert rem.approver is not None and (rem.approver.kind, rem.approver.name) == ("human", "alice")
    assert rem.rule.startswith("alice asked Delete")
    again = await ask(
        PersonRepairRequest(
            by="alice",
            request_id="a2",
            node="gpu-a",
            action=Action.DELETE,
            evidence=[evidence("gpu-a")],
        )
    )
    assert not again.created and again.remediation.id == rem.id
    done = await fleet.remediation_in("gpu-a", RemediationState.DONE)
    assert done.id == rem.id

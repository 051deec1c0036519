"""Node labels' syntax and the repair contract on them (R8), without a bus."""

from __future__ import annotations

import pytest

from app.cli.labels import detector_named, parse_changes
from libs.contracts.base import now
from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.remediation import (
    LABEL_ACTION,
    LABEL_EVIDENCE,
    LABEL_REASON,
    LABEL_REQUEST_ID,
    LABEL_SEVERITY,
    Action,
    LabelRequest,
)
from services.remediator import labels


def test_kubectl_syntax_sets_and_removes() -> None:
    assert parse_changes(["a=1", "b/c=", "d-"]) == ({"a": "1", "b/c": ""}, ["d"])
    for bad in (["nothing"], ["-"], ["a=1", "a=2"]):
        with pytest.raises(NodusError):
            parse_changes(bad)


def test_keys_and_values_follow_label_syntax() -> None:
    labels.check_key("repair.nodus.io/action")
    labels.check_key("team")
    for key in ("", "a/", "/a", "Upper.Case/x", "a b", "x" * 64):
        with pytest.raises(NodusError) as caught:
            labels.check_key(key)
        assert caught.value.code is ErrorCode.INVALID
    labels.check_value(LABEL_EVIDENCE, "NVRM: Xid 48, DBE (0x1)")  # free text
    with pytest.raises(NodusError):
        labels.check_value("team", "two words")
    with pytest.raises(NodusError):
        labels.check_value(LABEL_REASON, "a\nb")


def test_a_repair_by_label_is_the_detectors_request() -> None:
    request = LabelRequest(
        node="gpu-a",
        set={
            LABEL_ACTION: "Reboot",
            LABEL_REQUEST_ID: "r1",
            LABEL_EVIDENCE: "GPU 0: FAULTY",
            LABEL_SEVERITY: "critical",
        },
    )
    assert labels.asks_repair(request)
    applied = labels.apply(None, request, "npd", now())
    asked = labels.repair_request(applied, "npd")
    assert (asked.detector, asked.request_id, asked.action) == ("npd", "r1", Action.REBOOT)
    assert asked.evidence[0].source == "external:npd"
    assert asked.evidence[0].severity == "critical"
    assert not labels.asks_repair(LabelRequest(node="gpu-a", remove=[LABEL_ACTION]))
    for action, words in (("delete", "person's decision"), ("power-cycle", "R12"), ("x", "one of")):
        bad = labels.apply(
            None,
            LabelRequest(node="gpu-a", set={**request.set, LABEL_ACTION: action}),
            "npd",
            now(),
        )
        with pytest.raises(NodusError) as caught:
            labels.repair_request(bad, "npd")
        assert words in caught.value.message


def test_a_detectors_credentials_decide_its_name() -> None:
    assert detector_named("npd", None) == "npd"
    assert detector_named("npd", "npd") == "npd"
    assert detector_named(None, "burn") == "burn"  # an operator's credentials
    assert detector_named(None, None) is None  # an operator asking as a person
    with pytest.raises(NodusError):
        detector_named("npd", "burn")

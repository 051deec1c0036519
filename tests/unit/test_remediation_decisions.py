"""The sans-I/O decisions of node repair: alerts and persistence (R2, R13), the action table
(R4, R12), the ladder (R9, R10), migrate without critical evidence (R11), policy and consent
(R5, R8), idle wait (R6), guardrails (R13) and the state machine (R7, R14)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import msgspec
import pytest

from libs.contracts.base import decode, encode
from libs.contracts.remediation import (
    Action,
    Alert,
    AlertKind,
    AlertState,
    Approver,
    Evidence,
    Finding,
    IdleWait,
    Ladder,
    LadderAttempt,
    Outcome,
    Policy,
    Remediation,
    RemediationState,
    Requester,
    SignalReport,
    XidConsent,
)
from services.remediator import guardrails, ladder, lifecycle, policy
from services.remediator.alerts import (
    AlertSettings,
    Placement,
    after_repair,
    alert_id,
    next_alert,
    report_changes,
)
from services.remediator.decide import effective_action, has_failed_check, recommend

T0 = datetime(2025, 1, 1, tzinfo=UTC)
SETTINGS = guardrails.Settings(persistence=timedelta(minutes=2))


def evidence(
    kind: AlertKind = AlertKind.XID, severity: str = "critical", xid: int | None = 79
) -> Evidence:
    return Evidence(
        kind=kind,
        source="kmsg",
        node="gpu-07",
        where="/x/kmsg",
        observed_time=T0,
        severity=severity,  # type: ignore[arg-type]
        lines=["NVRM: Xid (PCI:0000:3b:00): 79, pid=1, name=p, GPU has fallen off the bus."],
        xid=xid,
    )


def finding(xid: int = 79, kind: AlertKind = AlertKind.XID, severity: str = "critical") -> Finding:
    return Finding(
        kind=kind,
        subject="0000:3b:00",
        severity=severity,  # type: ignore[arg-type]
        detail="GPU has fallen off the bus.",
        evidence=evidence(kind, severity, xid if kind is AlertKind.XID else None),
        xid=xid if kind is AlertKind.XID else None,
    )


def report(at: datetime, *findings: Finding, source: str = "kmsg") -> SignalReport:
    return SignalReport(node="gpu-07", source=source, observed_time=at, findings=list(findings))


def fire(at: datetime = T0, current: Alert | None = None, f: Finding | None = None) -> Alert:
    f = f or finding()
    alert = next_alert(current, f, report(at, f), Placement("c1", "p1"), at, AlertSettings())
    assert alert is not None
    return alert


def clear(alert: Alert, at: datetime) -> Alert:
    cleared = next_alert(alert, None, report(at), Placement(), at, AlertSettings())
    assert cleared is not None
    return cleared


# -- alerts (R2) ---------------------------------------------------------------------------------


def test_alert_has_stable_summary_description_and_evidence() -> None:
    alert = fire()
    assert (
        alert.id
        == "gpu-07.xid-79.0000-3b-00"
        == alert_id("gpu-07", AlertKind.XID, "0000:3b:00", 79)
    )
    assert alert.summary == "Xid 79 (GPU has fallen off the bus) on GPU 0000:3b:00 on gpu-07"
    assert "power cycled" in alert.description
    assert alert.evidence[0].lines and alert.evidence[0].where == "/x/kmsg"
    assert alert.action is Action.POWER_CYCLE and alert.state is AlertState.FIRING
    assert (alert.cluster, alert.pool) == ("c1", "p1")
    # the JSON the CLI, API and notifications carry is this record, camelCase
    document = msgspec.json.decode(encode(alert))
    assert {"summary", "description", "evidence", "windowStartTime"} <= set(document)
    assert decode(encode(alert), Alert) == alert


def test_alert_is_idempotent_and_refuses_stale_reports() -> None:
    alert = fire()
    f = finding()
    assert next_alert(alert, f, report(T0, f), Placement(), T0, AlertSettings()) is None
    resolved = clear(alert, T0 + timedelta(seconds=5))
    # an older report that still had the finding does not bring it back
    assert (
        next_alert(
            resolved, f, report(T0 + timedelta(seconds=1), f), Placement(), T0, AlertSettings()
        )
        is None
    )


def test_report_changes_resolve_what_the_source_no_longer_sees() -> None:
    firing = fire()
    other_source = msgspec.structs.replace(
        fire(f=finding(kind=AlertKind.ECC_DOUBLE_BIT)), source="dcgm"
    )
    touched = report_changes(report(T0 + timedelta(seconds=1)), [firing, other_source])
    assert touched == [(firing.id, None)]


# -- persistence and flapping (R13) ------------------------------------------------------------


def test_recommendation_only_after_the_persistence_window() -> None:
    alert = fire()
    assert recommend(alert, None, T0 + timedelta(minutes=1), SETTINGS) is None
    rec = recommend(alert, None, T0 + timedelta(minutes=2), SETTINGS)
    assert rec is not None and rec.action is Action.POWER_CYCLE
    assert "Xid 79 -> PowerCycle" in rec.rule


def test_flapping_does_not_reset_the_window() -> None:
    alert = fire()
    at = T0
    for _ in range(4):  # clears and comes back every 30 s
        at += timedelta(seconds=30)
        alert = clear(alert, at)
        assert recommend(alert, None, at, SETTINGS) is None  # gone while cleared
        at += timedelta(seconds=1)
        alert = fire(at, alert)
    assert alert.window_start_time == T0 and alert.flaps == 4
    assert recommend(alert, None, at, SETTINGS) is not None  # 2 min since it first fired


def test_a_comeback_after_the_flap_memory_is_a_new_episode() -> None:
    alert = clear(fire(), T0 + timedelta(seconds=10))
    back = fire(T0 + timedelta(hours=1), alert)
    assert back.window_start_time == T0 + timedelta(hours=1) and back.generation == 2


def test_recommendation_disappears_when_the_alert_clears() -> None:
    alert = fire()
    assert recommend(alert, None, T0 + timedelta(minutes=5), SETTINGS) is not None
    assert (
        recommend(
            clear(alert, T0 + timedelta(minutes=5)), None, T0 + timedelta(minutes=5), SETTINGS
        )
        is None
    )


def test_after_a_repair_the_fault_must_persist_again() -> None:
    alert = fire()
    repaired = after_repair(alert, 1, T0 + timedelta(minutes=10))
    assert repaired is not None and repaired.generation == 2
    assert after_repair(repaired, 1, T0) is None  # once per generation
    assert recommend(repaired, None, T0 + timedelta(minutes=11), SETTINGS) is None
    assert recommend(repaired, None, T0 + timedelta(minutes=12), SETTINGS) is not None


# -- evidence (R3) -----------------------------------------------------------------------------


def test_not_ready_alone_is_no_evidence() -> None:
    not_ready = msgspec.structs.replace(evidence(AlertKind.NODE_NOT_READY, "info", None))
    assert not has_failed_check([not_ready])
    assert not has_failed_check([msgspec.structs.replace(evidence(), lines=[], values={})])
    assert has_failed_check([not_ready, evidence()])
    alert = fire(f=finding(kind=AlertKind.NODE_NOT_READY, severity="info"))
    assert alert.action is Action.NONE
    assert recommend(alert, None, T0 + timedelta(days=1), SETTINGS) is None


# -- the table (R4, R12) -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "xid", "action"),
    [
        (AlertKind.XID, 79, Action.POWER_CYCLE),
        (AlertKind.XID, 48, Action.REBOOT),
        (AlertKind.XID, 95, Action.REBOOT),
        (AlertKind.XID, 119, Action.REBOOT),
        (AlertKind.XID, 13, Action.NONE),
        (AlertKind.XID, 94, Action.NONE),
        (AlertKind.GPU_OFF_BUS, None, Action.POWER_CYCLE),
        (AlertKind.ECC_DOUBLE_BIT, None, Action.REBOOT),
        (AlertKind.ROW_REMAP_FAILURE, None, Action.MIGRATE),
        (AlertKind.READONLY_FILESYSTEM, None, Action.REBOOT),
        (AlertKind.INFINIBAND_PORT_DOWN, None, Action.REBOOT),
        (AlertKind.HOST_UNREACHABLE, None, Action.REBOOT),
        (AlertKind.NODE_NOT_READY, None, Action.NONE),
    ],
)
def test_lightest_action(kind: AlertKind, xid: int | None, action: Action) -> None:
    alert = fire(f=finding(xid or 0, kind))
    assert alert.action is action


# -- the ladder (R9, R10) ------------------------------------------------------------------------


def attempt(
    action: Action, days_ago: float, outcome: Outcome = Outcome.DONE, n: int = 0
) -> LadderAttempt:
    return LadderAttempt(
        remediation_id=f"r{n}-{action}-{days_ago}-{outcome}",
        action=action,
        time=T0 - timedelta(days=days_ago),
        outcome=outcome,
    )


def make_ladder(*attempts: LadderAttempt) -> Ladder:
    return Ladder(
        key="k", node="gpu-07", cluster="c1", kind=AlertKind.XID, xid=48, attempts=list(attempts)
    )


def test_two_runs_of_the_same_action_step_up_one_rung() -> None:
    one = make_ladder(attempt(Action.REBOOT, 1))
    assert ladder.escalate(Action.REBOOT, one, T0)[0] is Action.REBOOT
    two = make_ladder(attempt(Action.REBOOT, 1), attempt(Action.REBOOT, 2, Outcome.FAILED))
    action, why = ladder.escalate(Action.REBOOT, two, T0)
    assert action is Action.REPROVISION and "R10" in why[0]
    four = make_ladder(
        *two.attempts, attempt(Action.REPROVISION, 1), attempt(Action.REPROVISION, 0.5)
    )
    assert ladder.escalate(Action.REBOOT, four, T0)[0] is Action.MIGRATE
    six = make_ladder(*four.attempts, attempt(Action.MIGRATE, 0.2), attempt(Action.MIGRATE, 0.1))
    assert ladder.escalate(Action.REBOOT, six, T0)[0] is Action.DELETE
    power = make_ladder(attempt(Action.POWER_CYCLE, 1), attempt(Action.POWER_CYCLE, 2))
    assert ladder.escalate(Action.POWER_CYCLE, power, T0)[0] is Action.REPROVISION


def test_old_cancelled_and_self_resolved_attempts_do_not_count() -> None:
    for other in (
        attempt(Action.REBOOT, 8),
        attempt(Action.REBOOT, 1, Outcome.CANCELLED),
        attempt(Action.REBOOT, 1, Outcome.SELF_RESOLVED),
    ):
        assert (
            ladder.escalate(Action.REBOOT, make_ladder(attempt(Action.REBOOT, 1), other), T0)[0]
            is Action.REBOOT
        )


def test_ladders_are_per_machine_cluster_alert_and_xid() -> None:
    keys = {
        ladder.ladder_key("a", "c", AlertKind.XID, 48),
        ladder.ladder_key("b", "c", AlertKind.XID, 48),
        ladder.ladder_key("a", "d", AlertKind.XID, 48),
        ladder.ladder_key("a", "c", AlertKind.XID, 79),
        ladder.ladder_key("a", "c", AlertKind.ECC_DOUBLE_BIT, None),
    }
    assert len(keys) == 5


def test_ladder_record_is_idempotent_and_forgets_old_attempts() -> None:
    first = attempt(Action.REBOOT, 0)
    lad = ladder.record(
        make_ladder(attempt(Action.REBOOT, 9)), "k", "n", "c", AlertKind.XID, 48, first, T0
    )
    assert lad is not None and [a.remediation_id for a in lad.attempts] == [first.remediation_id]
    assert ladder.record(lad, "k", "n", "c", AlertKind.XID, 48, first, T0) is None


def test_the_recommendation_climbs_with_the_ladder() -> None:
    alert = fire(f=finding(48))
    two = make_ladder(attempt(Action.REBOOT, 1), attempt(Action.REBOOT, 2))
    rec = recommend(alert, two, T0 + timedelta(minutes=3), SETTINGS)
    assert rec is not None and rec.action is Action.REPROVISION and rec.base_action is Action.REBOOT


# -- R11 ---------------------------------------------------------------------------------------


def test_migrate_without_critical_evidence_runs_as_reprovision() -> None:
    warning = evidence(AlertKind.THERMAL_THROTTLING, "warning", None)
    assert effective_action(Action.MIGRATE, [warning])[0] is Action.REPROVISION
    assert effective_action(Action.MIGRATE, [warning, evidence()])[0] is Action.MIGRATE
    assert effective_action(Action.REBOOT, [warning])[0] is Action.REBOOT
    thermal = fire(f=finding(kind=AlertKind.THERMAL_THROTTLING, severity="warning"))
    rec = recommend(thermal, None, T0 + timedelta(minutes=3), SETTINGS)
    assert rec is not None and rec.action is Action.MIGRATE and "R11" in rec.rule


# -- policy and consent (R5) -------------------------------------------------------------------


def test_default_policy_waits_for_a_person() -> None:
    decided = policy.approval(Policy(), "n", Action.REBOOT, 48)
    assert not decided.automatic and "ApproveBeforeRepair" in decided.rule


def test_automatic_is_a_checklist() -> None:
    auto = Policy(mode="Automatic", trusted_actions=[Action.REBOOT, Action.POWER_CYCLE])
    assert policy.approval(auto, "n", Action.REBOOT, None).automatic
    assert policy.approval(auto, "n", Action.POWER_CYCLE, 79).automatic
    assert not policy.approval(auto, "n", Action.MIGRATE, None).automatic
    assert not policy.approval(
        Policy(mode="Automatic", trusted_actions=[Action.DELETE]), "n", Action.DELETE, None
    ).automatic


def test_consent_per_xid_code() -> None:
    consent = Policy(
        xid_consent={
            119: XidConsent(auto=[Action.REBOOT]),
            95: XidConsent(auto=[Action.REBOOT], approve=[Action.MIGRATE]),
        },
    )
    assert policy.approval(consent, "n", Action.REBOOT, 119).automatic
    assert policy.approval(consent, "n", Action.REBOOT, 95).automatic
    assert not policy.approval(consent, "n", Action.REBOOT, 48).automatic
    auto = msgspec.structs.replace(consent, mode="Automatic", trusted_actions=[Action.MIGRATE])
    decided = policy.approval(auto, "n", Action.MIGRATE, 95)
    assert not decided.automatic and "Xid 95" in decided.rule
    assert not policy.approval(
        msgspec.structs.replace(auto, approval_required_nodes=["n"]), "n", Action.REBOOT, 119
    ).automatic


def test_policy_json_and_the_idle_cap() -> None:
    document = {
        "mode": "Automatic",
        "trustedActions": ["Reboot"],
        "xidConsent": {"119": {"auto": ["Reboot"]}},
        "idle": {"maxWaitSeconds": 3600},
    }
    parsed = msgspec.convert(document, Policy, strict=False)
    assert parsed.xid_consent[119].auto == [Action.REBOOT]
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"idle": {"maxWaitSeconds": 25 * 3600}}, Policy, strict=False)
    assert IdleWait().max_wait_seconds == 7200
    assert policy.effective({"default": parsed}, "c9") is parsed
    assert policy.effective({}, "c9") == Policy()


# -- guardrails (R13) --------------------------------------------------------------------------


def test_budget_sized_from_the_cluster() -> None:
    settings = guardrails.Settings(budget_fraction=0.05, budget_min=1)
    assert guardrails.budget(10, settings) == 1
    assert guardrails.budget(500, settings) == 25


def test_cooldown() -> None:
    assert guardrails.cooldown_until(None, SETTINGS) is None
    assert guardrails.cooldown_until(T0, SETTINGS) == T0 + timedelta(minutes=30)


def test_slots_hold_one_per_pool_and_drop_stale_holders() -> None:
    grace = timedelta(seconds=30)
    slots = guardrails.take_slot(None, "pool.p", "a", 1, {"a"}, T0, grace)
    assert slots is not None
    assert guardrails.take_slot(slots, "pool.p", "a", 1, {"a"}, T0, grace) is slots  # idempotent
    assert guardrails.take_slot(slots, "pool.p", "b", 1, {"a", "b"}, T0, grace) is None
    # a holds no live repair any more and the grace passed: b gets the slot
    later = T0 + timedelta(minutes=1)
    taken = guardrails.take_slot(slots, "pool.p", "b", 1, {"b"}, later, grace)
    assert taken is not None and set(taken.holders) == {"b"}
    released = guardrails.release_slot(taken, "b")
    assert released is not None and released.holders == {}
    assert guardrails.release_slot(released, "b") is None


def test_breaker_opens_on_a_surge_stays_open_and_resets_without_replay() -> None:
    settings = guardrails.Settings(
        breaker_surge=3, breaker_fraction=0.0, breaker_window=timedelta(minutes=10)
    )
    breaker = None
    for i in range(3):
        new, ok = guardrails.breaker_admit(breaker, "c1", f"r{i}", 100, T0, settings)
        assert ok and new is not None
        breaker = new
        # counting the same repair again changes nothing
        assert guardrails.breaker_admit(breaker, "c1", f"r{i}", 100, T0, settings) == (None, True)
    tripped, ok = guardrails.breaker_admit(breaker, "c1", "r3", 100, T0, settings)
    assert not ok and tripped is not None and tripped.open and tripped.held == ["r3"]
    # stays open, however long it has been
    assert guardrails.breaker_admit(tripped, "c1", "r4", 100, T0 + timedelta(days=3), settings) == (
        None,
        False,
    )
    held = guardrails.breaker_hold(tripped, "r4")
    assert held is not None and held.held == ["r3", "r4"]
    closed = guardrails.breaker_reset(held, "c1", "alice", T0)
    assert not closed.open and closed.recent == [] and closed.reset_by == "alice"
    assert closed.held == ["r3", "r4"]  # the record keeps what was held; nothing re-runs
    assert guardrails.breaker_admit(closed, "c1", "r5", 100, T0, settings)[1]


def test_surge_window_slides() -> None:
    settings = guardrails.Settings(
        breaker_surge=2, breaker_fraction=0.0, breaker_window=timedelta(minutes=10)
    )
    breaker = None
    for i in range(10):  # one every 6 minutes never makes a surge
        new, ok = guardrails.breaker_admit(
            breaker, "c1", f"r{i}", 100, T0 + timedelta(minutes=6 * i), settings
        )
        assert ok
        breaker = new
    assert guardrails.surge(1000, guardrails.Settings(breaker_surge=5, breaker_fraction=0.02)) == 20


# -- the state machine (R6, R7, R12) -----------------------------------------------------------


def remediation(action: Action = Action.REBOOT, **changes: object) -> Remediation:
    rem = Remediation(
        id="gpu-07.abc",
        node="gpu-07",
        action=action,
        requested_action=action,
        state=RemediationState.PENDING,
        requester=Requester(kind="automatic", name="remediator"),
        rule="Xid 48 -> Reboot",
        evidence=[evidence()],
        created_time=T0,
    )
    return msgspec.structs.replace(rem, **changes)


def test_transitions_are_recorded() -> None:
    rem = lifecycle.approve(remediation(), Approver(kind="human", name="alice"), T0)
    assert rem.state is RemediationState.APPROVED and rem.approved_time == T0
    assert rem.history[-1].by == "alice"
    rem = lifecycle.finish(rem, Outcome.SELF_RESOLVED, T0, "remediator", "alert cleared")
    assert rem.state is RemediationState.CANCELLED and rem.outcome is Outcome.SELF_RESOLVED
    assert [h.state for h in rem.history] == [RemediationState.APPROVED, RemediationState.CANCELLED]


def test_idle_wait_default_two_hours_then_interrupt() -> None:
    rem = lifecycle.start_waiting(remediation(), Policy(), T0, "r")
    assert rem.idle_deadline_time == T0 + timedelta(hours=2)
    assert lifecycle.idle_decision(rem, [], T0).go
    waiting = lifecycle.idle_decision(rem, ["acme.train"], T0 + timedelta(hours=1))
    assert not waiting.go and "acme.train" in waiting.reason
    late = lifecycle.idle_decision(rem, ["acme.train"], T0 + timedelta(hours=2, seconds=1))
    assert late.go and late.interrupt == ["acme.train"]


def test_never_interrupt_waits_without_limit() -> None:
    never = Policy(idle=IdleWait(never_interrupt=True))
    rem = lifecycle.start_waiting(remediation(), never, T0, "r")
    assert rem.idle_deadline_time is None
    assert not lifecycle.idle_decision(rem, ["acme.train"], T0 + timedelta(days=30)).go


def test_boot_id_check_never_cycles_a_host_that_came_back() -> None:
    rem = remediation(
        Action.POWER_CYCLE,
        state=RemediationState.RUNNING,
        started_time=T0,
        boot_id_before="boot-1",
        op_id="op",
    )
    assert lifecycle.issue_decision(rem, "boot-1", False)[0] == "issue"
    decision, why = lifecycle.issue_decision(rem, "boot-2", False)
    assert decision == "skip" and "R12" in why
    assert lifecycle.issue_decision(rem, "boot-1", True)[0] == "skip"  # provider did it


def test_came_back() -> None:
    issued = remediation(
        Action.REBOOT, boot_id_before="b1", issued_time=T0, host_before="h1", started_time=T0
    )
    assert not lifecycle.came_back(issued, "b1", "h1", False)
    assert lifecycle.came_back(issued, "b2", "h1", False)
    assert not lifecycle.came_back(
        msgspec.structs.replace(issued, issued_time=None), "b2", "h1", False
    )
    migrate = msgspec.structs.replace(issued, action=Action.MIGRATE)
    assert not lifecycle.came_back(migrate, "b2", "h1", False)
    assert lifecycle.came_back(migrate, "b2", "h2", False)
    delete = msgspec.structs.replace(issued, action=Action.DELETE)
    assert lifecycle.came_back(delete, "", "", True)
    assert lifecycle.timed_out(issued, T0 + timedelta(minutes=16), timedelta(minutes=15))

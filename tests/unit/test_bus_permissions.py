"""What a bus user may publish, read from the server's answer as NATS matches permissions,
and which relay a user is: how a relay knows at start it was given another relay's seed."""

from __future__ import annotations

from libs.bus.auth import (
    SERVICE,
    Identity,
    agent_permissions,
    may_publish,
    permissions,
    relay_of,
    relay_permissions,
)

RECORD_A = "$KV.nodus-relays.relay-a"
RECORD_B = "$KV.nodus-relays.relay-b"


def test_a_relays_user_may_write_its_own_record_and_no_other() -> None:
    info = {"permissions": relay_permissions("relay-a")}
    assert may_publish(info, RECORD_A)
    assert not may_publish(info, RECORD_B)
    assert relay_of(info) == "relay-a"


def test_other_users_are_no_relay_but_a_services_may_write_any_record() -> None:
    agent = {"permissions": agent_permissions("gpu-1")}
    assert not may_publish(agent, RECORD_A) and relay_of(agent) is None
    service = {"permissions": permissions(Identity("placer", SERVICE, "SU", "UKEY"))}
    assert may_publish(service, RECORD_A) and relay_of(service) is None
    operator = {"user": "UOPERATOR"}  # not confined
    assert may_publish(operator, RECORD_A) and relay_of(operator) is None


def test_subjects_match_token_by_token() -> None:
    def allowed(*patterns: str, deny: tuple[str, ...] = ()) -> dict[str, object]:
        return {"permissions": {"publish": {"allow": list(patterns), "deny": list(deny)}}}

    assert may_publish(allowed("a.*.c"), "a.b.c")
    assert not may_publish(allowed("a.*.c"), "a.b.c.d")
    assert may_publish(allowed("a.>"), "a.b.c")
    assert not may_publish(allowed("a.>"), "a")
    assert not may_publish(allowed("a.b"), "a.bb")
    assert not may_publish(allowed(">", deny=("a.*",)), "a.b")

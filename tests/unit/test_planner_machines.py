"""The placer's planner, sans-I/O: which machines a gang may use: one accelerator backend
(C5), capabilities (C6), accelerators, exclusions, no false "unschedulable" whatever the
order it meets machines, the tunnel buffer agents allow (C3)."""

from __future__ import annotations

from libs.contracts.errors import ErrorCode
from libs.contracts.jobs import PathClass
from services.placer.planner import Exclusions, Planner
from tests.factories import job
from tests.planner_support import (
    BASE_CAPS,
    VM_CAPS,
    auto,
    codes,
    config,
    container,
    direct,
    must_not_place,
    must_place,
    private_vm,
    vm,
)

# -- one accelerator backend (C5) ---------------------------------------------------------------


def test_members_share_one_accelerator_backend() -> None:
    records = [
        vm("a", "10.0.0.1", accelerators={"count": 8, "backend": "cuda", "model": "H100"}),
        vm("b", "10.0.0.2", accelerators={"count": 8, "backend": "rocm", "model": "MI300X"}),
    ]
    must_not_place(direct(), records)
    records.append(
        vm("c", "10.0.0.3", accelerators={"count": 8, "backend": "rocm", "model": "MI300X"})
    )
    plan = must_place(direct(), records)
    assert plan.nodes == ["b", "c"]


def test_one_backend_on_the_relayed_path_too() -> None:
    records = [
        container("c1", "10.0.0.1", accelerators={"count": 1, "backend": "cuda", "model": "L4"}),
        container("c2", "10.0.0.2", accelerators={"count": 1, "backend": "rocm", "model": "MI210"}),
    ]
    must_not_place(auto(), records)


def test_one_backend_on_the_private_path_too() -> None:
    records = [
        private_vm(
            "a",
            "10.0.0.1",
            "172.16.0.1",
            accelerators={"count": 8, "backend": "cuda", "model": "H100"},
        ),
        private_vm(
            "b",
            "10.0.0.2",
            "172.16.0.2",
            accelerators={"count": 8, "backend": "rocm", "model": "MI300X"},
        ),
    ]
    must_not_place(direct(), records)


# -- capabilities (C6) --------------------------------------------------------------------------


def test_a_node_lacking_a_required_capability_is_not_used() -> None:
    records = [
        vm("old", "10.0.0.1", caps=["register", "heartbeat"]),
        vm("b", "10.0.0.2"),
        vm("c", "10.0.0.3"),
    ]
    plan = must_place(direct(), records)
    assert "old" not in plan.nodes


def test_a_fleet_lacking_a_capability_is_refused_with_missing_capability() -> None:
    records = [vm("a", "10.0.0.1", caps=["register"]), vm("b", "10.0.0.2", caps=["register"])]
    shortfalls = must_not_place(direct(), records)
    assert codes(shortfalls)[PathClass.DIRECT] is ErrorCode.MISSING_CAPABILITY
    assert "join-epoch" in next(s.message for s in shortfalls if s.path is PathClass.DIRECT)


def test_missing_capability_on_every_path_of_an_auto_job() -> None:
    records = [
        private_vm("a", "10.0.0.1", "172.16.0.1", caps=[]),
        container("c", "10.0.0.2", caps=[]),
        private_vm("b", "10.0.0.3", "172.16.0.3", caps=[]),
    ]
    shortfalls = must_not_place(auto(), records)
    assert codes(shortfalls) == {
        PathClass.PRIVATE: ErrorCode.MISSING_CAPABILITY,
        PathClass.DIRECT: ErrorCode.MISSING_CAPABILITY,
        PathClass.RELAYED: ErrorCode.MISSING_CAPABILITY,
    }


def test_configured_path_capability_is_required_on_that_path_only() -> None:
    cfg = config()
    cfg.required_capabilities.relayed = ["socks5"]
    records = [container("c1", "10.0.0.1"), container("c2", "10.0.0.2")]
    shortfalls = must_not_place(auto(), records, cfg=cfg)
    assert codes(shortfalls)[PathClass.RELAYED] is ErrorCode.MISSING_CAPABILITY
    capable = [
        container("c1", "10.0.0.1", caps=[*BASE_CAPS, "socks5"]),
        container("c2", "10.0.0.2", caps=[*BASE_CAPS, "socks5"]),
    ]
    assert must_place(auto(), capable, cfg=cfg).path is PathClass.RELAYED
    # and the VMs of a Direct gang do not need it
    assert (
        must_place(direct(), [vm("a", "10.0.0.1"), vm("b", "10.0.0.2")], cfg=cfg).path
        is PathClass.DIRECT
    )


# -- accelerators ------------------------------------------------------------------------------


def test_accelerator_count_is_at_least() -> None:
    records = [
        vm("small", "10.0.0.1", accelerators={"count": 2, "backend": "cuda", "model": "H100"}),
        vm("b", "10.0.0.2", accelerators={"count": 4, "backend": "cuda", "model": "H100"}),
        vm("c", "10.0.0.3", accelerators={"count": 8, "backend": "cuda", "model": "H100"}),
    ]
    plan = must_place(direct(accelerators={"count": 4}), records)
    assert plan.nodes == ["b", "c"]


def test_accelerator_backend_and_model_are_equal_where_given() -> None:
    records = [
        vm("h1", "10.0.0.1", accelerators={"count": 8, "backend": "cuda", "model": "H100"}),
        vm("a1", "10.0.0.2", accelerators={"count": 8, "backend": "cuda", "model": "A100"}),
        vm("h2", "10.0.0.3", accelerators={"count": 8, "backend": "cuda", "model": "H100"}),
        vm("m1", "10.0.0.4", accelerators={"count": 8, "backend": "rocm", "model": "MI300X"}),
        vm("m2", "10.0.0.5", accelerators={"count": 8, "backend": "rocm", "model": "MI300X"}),
    ]
    assert must_place(direct(accelerators={"model": "H100"}), records).nodes == ["h1", "h2"]
    assert must_place(direct(accelerators={"backend": "rocm"}), records).nodes == ["m1", "m2"]
    must_not_place(direct(accelerators={"backend": "cuda", "model": "MI300X"}), records)


def test_no_machine_with_the_accelerators_is_unsatisfiable_and_says_what_was_asked() -> None:
    records = [vm("a", "10.0.0.1"), vm("b", "10.0.0.2")]
    shortfalls = must_not_place(
        direct(accelerators={"count": 2, "backend": "rocm", "model": "MI300X"}), records
    )
    assert shortfalls[0].code is ErrorCode.UNSATISFIABLE
    assert "2x rocm MI300X" in shortfalls[0].message


def test_zero_accelerators_asked_accepts_any_machine() -> None:
    records = [
        vm("a", "10.0.0.1", accelerators={"count": 0, "backend": "cuda", "model": "none"}),
        vm("b", "10.0.0.2", accelerators={"count": 0, "backend": "cuda", "model": "none"}),
    ]
    assert must_place(direct(accelerators={"count": 0}), records).path is PathClass.DIRECT
    must_not_place(direct(), records)  # the default asks for one


# -- exclusions ---------------------------------------------------------------------------------


def test_excluded_nodes_are_not_used() -> None:
    records = [vm("a", "10.0.0.1"), vm("b", "10.0.0.2"), vm("c", "10.0.0.3")]
    plan = must_place(direct(), records, exclusions=Exclusions(nodes={"a"}))
    assert plan.nodes == ["b", "c"]
    must_not_place(direct(), records, exclusions=Exclusions(nodes={"a", "b"}))


def test_excluded_addresses_are_not_advertised_on_relayed() -> None:
    records = [
        container("c1", "10.0.0.1"),
        container("c2", "10.0.0.2"),
        container("c3", "10.0.0.3"),
    ]
    plan = must_place(auto(), records, exclusions=Exclusions(addresses={"10.0.0.1"}))
    assert "10.0.0.1" not in [m.address for m in plan.members]
    must_not_place(auto(), records, exclusions=Exclusions(addresses={"10.0.0.1", "10.0.0.2"}))


def test_excluded_addresses_are_not_advertised_on_private() -> None:
    records = [
        private_vm("a", "10.0.0.1", "172.16.0.1"),
        private_vm("b", "10.0.0.2", "172.16.0.2"),
        private_vm("c", "10.0.0.3", "172.16.0.3"),
    ]
    plan = must_place(direct(), records, exclusions=Exclusions(addresses={"172.16.0.2"}))
    assert plan.path is PathClass.PRIVATE
    assert plan.nodes == ["a", "c"]


def test_excluding_a_nodes_only_machine_explains_the_shortfall() -> None:
    records = [vm("a", "10.0.0.1"), vm("b", "10.0.0.2")]
    shortfalls = must_not_place(direct(), records, exclusions=Exclusions(nodes={"a", "b"}))
    assert any(s.code is ErrorCode.UNSATISFIABLE for s in shortfalls)


# -- no false "unschedulable": the planner is not fooled by the order it meets machines --------


def test_relayed_gang_found_when_the_first_vm_shares_an_address_with_the_only_container() -> None:
    # vm1 and c1 share 10.0.0.1, so vm1+c1 is not a gang; vm1+vm2 is not qualified for Relayed
    # and neither VM can create the WireGuard device. vm2+c1 is a valid Relayed gang (G5, G6).
    records = [
        vm("vm1", "10.0.0.1", caps=BASE_CAPS),
        vm("vm2", "10.0.0.2", caps=BASE_CAPS),
        container("c1", "10.0.0.1"),
    ]
    plan = must_place(auto(), records)
    assert plan.path is PathClass.RELAYED
    assert sorted(plan.nodes) == ["c1", "vm2"]


def test_qualified_gang_found_even_when_the_first_machine_is_in_no_qualified_gang() -> None:
    cfg = config()
    cfg.qualified.direct = ["aws/vm+gcp/vm", "gcp/vm+azure/vm", "azure/vm+azure/vm"]
    records = [
        vm("a-aws", "10.0.0.1", provider="aws"),
        vm("b-gcp", "10.0.0.2", provider="gcp"),
        vm("c-azure", "10.0.0.3", provider="azure"),
        vm("d-azure", "10.0.0.4", provider="azure"),
    ]
    # gcp+azure+azure: every pair qualified.
    plan = must_place(direct(3), records, cfg=cfg)
    assert plan.nodes == ["b-gcp", "c-azure", "d-azure"]


def test_a_private_gang_may_mix_models_when_the_job_names_none() -> None:
    # Found by the no-false-unschedulable property: the private index must not split by model.
    records = [
        vm("h100", "10.0.0.1", privateNetwork="vpc-a", privateAddress="172.16.0.1", caps=VM_CAPS),
        vm(
            "a100",
            "10.0.0.2",
            privateNetwork="vpc-a",
            privateAddress="172.16.0.2",
            caps=VM_CAPS,
            accelerators={"count": 8, "backend": "cuda", "model": "A100"},
        ),
    ]
    plan, _ = Planner(config()).plan(
        job(distributed={"members": 2, "network": "Colocated"}), records
    )
    assert plan is not None and plan.path is PathClass.PRIVATE
    assert sorted(plan.nodes) == ["a100", "h100"]
    model_bound = job(accelerators={"model": "H100"}, distributed={"members": 2})
    plan, _ = Planner(config()).plan(model_bound, records)
    assert plan is None


def test_c3_a_plan_needing_more_tunnel_buffer_than_agents_allow_is_refused() -> None:
    small = [
        container("c1", "10.0.0.1", caps=BASE_CAPS),
        vm("v1", "10.0.0.2", caps=BASE_CAPS),
    ]
    for record in small:
        record.tunnel_buffer_limit_bytes = 1 << 20
    relayed = job(distributed={"members": 2, "transport": "Auto"})
    plan, shortfalls = Planner(config()).plan(relayed, small)
    assert plan is None
    refusal = next(s for s in shortfalls if s.path is PathClass.RELAYED)
    assert refusal.code is ErrorCode.BOUNDS_EXCEEDED
    assert "14 MiB" in refusal.message and "at most 1 MiB" in refusal.message
    for record in small:
        record.tunnel_buffer_limit_bytes = 64 << 20
    plan, _ = Planner(config()).plan(relayed, small)
    assert plan is not None and plan.path is PathClass.RELAYED

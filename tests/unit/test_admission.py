"""Admission refuses early, with a readable reason (G1, G2, G8, C5, C6), and the job file
parser refuses malformed input naming the field (S3)."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libs.client.client import parse_job
from libs.contracts.errors import ErrorCode, NodusError
from libs.contracts.fleet import NodeRecord
from libs.contracts.jobs import Job
from libs.contracts.placer import PlacerConfig
from services.placer.admission import check_feasible, check_static
from services.placer.config import load_config
from services.placer.planner import Planner
from tests.factories import job, machine, node_record

BASE_CAPS = ["register", "heartbeat", "join-epoch"]


def planner(**changes: Any) -> Planner:
    cfg: PlacerConfig = load_config()
    for name, value in changes.items():
        setattr(cfg, name, value)
    return Planner(cfg)


def refused(call: Any, *args: Any) -> NodusError:
    with pytest.raises(NodusError) as caught:
        call(*args)
    return caught.value


def containers(n: int) -> list[NodeRecord]:
    return [
        node_record(machine(f"c{i}", offering="container", address=f"10.0.0.{i + 1}"))
        for i in range(n)
    ]


def vms(n: int, caps: list[str] | None = None) -> list[NodeRecord]:
    return [
        node_record(machine(f"v{i}", address=f"10.1.0.{i + 1}"), capabilities=caps)
        for i in range(n)
    ]


# -- G1: per-org beta access ---------------------------------------------------------------------


def test_org_without_access_is_refused_with_a_readable_reason() -> None:
    error = refused(check_static, job(org="umbrella"), planner())
    assert error.code is ErrorCode.ACCESS_DENIED
    assert "umbrella" in error.message
    assert "beta" in error.message
    assert error.field == "$.metadata.org"


@pytest.mark.parametrize("org", ["acme", "globex", "initech"])
def test_orgs_with_access_pass(org: str) -> None:
    check_static(job(org=org), planner())


def test_star_opens_the_beta_to_every_org() -> None:
    check_static(job(org="umbrella"), planner(distributed_access=["*"]))


def test_no_org_has_access_when_the_list_is_empty() -> None:
    error = refused(check_static, job(org="acme"), planner(distributed_access=[]))
    assert error.code is ErrorCode.ACCESS_DENIED


# -- G8: LD_PRELOAD with transport Auto ------------------------------------------------------------


def test_spec_ld_preload_with_auto_is_refused() -> None:
    the_job = job(distributed={"members": 2, "transport": "Auto"}, env={"LD_PRELOAD": "/x.so"})
    error = refused(check_static, the_job, planner())
    assert error.code is ErrorCode.LD_PRELOAD_WITH_AUTO
    assert error.field == "$.spec.env.LD_PRELOAD"
    assert "spec.image.env" in error.message  # tells the user where it can go instead


def test_spec_ld_preload_with_direct_is_accepted() -> None:
    check_static(
        job(distributed={"members": 2, "transport": "Direct"}, env={"LD_PRELOAD": "/x.so"}),
        planner(),
    )


def test_image_ld_preload_with_auto_is_accepted() -> None:
    the_job = job(
        distributed={"members": 2, "transport": "Auto"}, image={"env": {"LD_PRELOAD": "/x.so"}}
    )
    check_static(the_job, planner())


# -- environment names and values -----------------------------------------------------------------


@pytest.mark.parametrize("name", ["1ABC", "A-B", "A=B", "", "A B", "NCCL.DEBUG", "É"])
@pytest.mark.parametrize("where", ["env", "image"])
def test_invalid_env_names_are_refused(name: str, where: str) -> None:
    spec: dict[str, Any] = (
        {"env": {name: "1"}} if where == "env" else {"image": {"env": {name: "1"}}}
    )
    error = refused(check_static, job(**spec), planner())
    assert error.code is ErrorCode.INVALID
    assert repr(name) in error.message
    assert error.field == ("$.spec.env" if where == "env" else "$.spec.image.env")


@pytest.mark.parametrize("name", ["A", "_x", "NCCL_DEBUG", "a1_B2"])
def test_valid_env_names_pass(name: str) -> None:
    check_static(job(env={name: "v"}), planner())


def test_nul_in_an_env_value_is_refused() -> None:
    error = refused(check_static, job(env={"A": "x\x00y"}), planner())
    assert error.code is ErrorCode.INVALID
    assert error.field == "$.spec.env.A"


# -- C5 at admission ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("backend", "var"), [("cuda", "HIP_VISIBLE_DEVICES"), ("rocm", "CUDA_VISIBLE_DEVICES")]
)
def test_other_backends_variable_with_a_requested_backend_is_refused(
    backend: str, var: str
) -> None:
    the_job = job(accelerators={"backend": backend}, env={var: "0"})
    error = refused(check_static, the_job, planner())
    assert error.code is ErrorCode.BACKEND_MISMATCH
    assert var in error.message


# -- feasibility on the registered fleet --------------------------------------------------------


def test_relayed_only_fleet_with_three_members_is_refused_with_the_member_limit() -> None:
    the_job = job(distributed={"members": 3, "transport": "Auto"})
    error = refused(check_feasible, the_job, planner(), containers(3))
    assert error.code is ErrorCode.RELAYED_MEMBERS
    assert "3" in error.message and "2" in error.message


def test_relayed_only_fleet_with_two_members_is_feasible() -> None:
    check_feasible(job(distributed={"members": 2, "transport": "Auto"}), planner(), containers(3))


def test_three_members_on_auto_are_feasible_on_vms() -> None:
    check_feasible(job(distributed={"members": 3, "transport": "Auto"}), planner(), vms(3))


def test_feasibility_accepts_any_iterable_of_records() -> None:
    # check_feasible is typed to take an Iterable; a one-shot iterator must see every machine
    # on every path, not only on the first one tried.
    check_feasible(job(distributed={"members": 2}), planner(), iter(vms(2)))


def test_container_fleet_with_transport_direct_is_unsatisfiable() -> None:
    error = refused(check_feasible, job(distributed={"members": 2}), planner(), containers(3))
    assert error.code is ErrorCode.UNSATISFIABLE
    assert "direct" in error.message


def test_fleet_of_old_agents_is_refused_with_missing_capability() -> None:
    error = refused(check_feasible, job(), planner(), vms(2, caps=BASE_CAPS))
    assert error.code is ErrorCode.MISSING_CAPABILITY
    assert "wireguard-device" in error.message


def test_fleet_too_small_is_unsatisfiable() -> None:
    error = refused(check_feasible, job(distributed={"members": 4}), planner(), vms(3))
    assert error.code is ErrorCode.UNSATISFIABLE


def test_unqualified_path_is_refused_with_not_qualified() -> None:
    p = planner()
    p.config.qualified.direct = []
    error = refused(check_feasible, job(), p, vms(2))
    assert error.code is ErrorCode.NOT_QUALIFIED


def test_accelerators_nowhere_in_the_fleet_is_unsatisfiable_with_the_ask() -> None:
    error = refused(check_feasible, job(accelerators={"backend": "rocm"}), planner(), vms(3))
    assert error.code is ErrorCode.UNSATISFIABLE
    assert "rocm" in error.message


def test_refusal_lists_every_paths_reason() -> None:
    error = refused(
        check_feasible,
        job(distributed={"members": 3, "transport": "Auto"}),
        planner(),
        containers(3),
    )
    for path in ("private", "direct"):
        assert f"{path}:" in error.message


# -- parse_job: malformed job files --------------------------------------------------------------

GOOD: dict[str, Any] = {
    "apiVersion": "nodus/v1",
    "kind": "Job",
    "metadata": {"name": "train", "org": "acme"},
    "spec": {"command": ["python", "train.py"], "distributed": {"members": 2}},
}


def with_change(path: str, value: Any) -> str:
    doc = yaml.safe_load(yaml.safe_dump(GOOD))
    keys = path.split(".")
    target = doc
    for key in keys[:-1]:
        target = target.setdefault(key, {})
    target[keys[-1]] = value
    return yaml.safe_dump(doc)


def parse_refused(text: str) -> NodusError:
    with pytest.raises(NodusError) as caught:
        parse_job(text, "job.yaml")
    assert caught.value.code is ErrorCode.INVALID
    assert "job.yaml" in caught.value.message
    return caught.value


def test_a_good_job_parses() -> None:
    parsed = parse_job(yaml.safe_dump(GOOD))
    assert parsed.metadata.name == "train"
    assert parsed.spec.distributed.members == 2
    assert parsed.spec.distributed.transport == "Direct"  # G5 default
    assert parsed.spec.distributed.network == "Global"


def test_status_in_the_file_is_ignored() -> None:
    doc = dict(GOOD, status={"phase": "Running", "epoch": 9})
    parsed = parse_job(yaml.safe_dump(doc))
    assert parsed.status.phase == "Pending"
    assert parsed.status.epoch == 0


@pytest.mark.parametrize("text", ["a: [1, 2", "spec: {command: [x]", "\t- :", "key: 'unterminated"])
def test_malformed_yaml_is_refused(text: str) -> None:
    error = parse_refused(text)
    assert "YAML" in error.message


@pytest.mark.parametrize("text", ["", "- 1\n- 2", "just a string", "42"])
def test_a_document_that_is_not_a_mapping_is_refused(text: str) -> None:
    error = parse_refused(text)
    assert "mapping" in error.message


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        ("spec.distributed.members", "two", "$.spec.distributed.members"),
        ("spec.distributed.members", 1, "$.spec.distributed.members"),
        ("spec.distributed.members", 9, "$.spec.distributed.members"),
        ("spec.distributed.members", True, "$.spec.distributed.members"),
        ("spec.distributed.network", "Local", "$.spec.distributed.network"),
        ("spec.distributed.transport", "Relayed", "$.spec.distributed.transport"),
        ("spec.accelerators.count", -1, "$.spec.accelerators.count"),
        ("spec.accelerators.count", 65, "$.spec.accelerators.count"),
        ("spec.accelerators.backend", "cuda12", "$.spec.accelerators.backend"),
        ("spec.image.libc", "uclibc", "$.spec.image.libc"),
        ("spec.command", [], "$.spec.command"),
        ("spec.command", "python train.py", "$.spec.command"),
        ("metadata.name", "Train_1", "$.metadata.name"),
        ("metadata.org", "a" * 64, "$.metadata.org"),
        ("apiVersion", "nodus/v2", "$.apiVersion"),
        ("kind", "Deployment", "$.kind"),
    ],
)
def test_wrong_types_and_out_of_range_values_name_the_field(
    path: str, value: Any, field: str
) -> None:
    error = parse_refused(with_change(path, value))
    assert field in error.message


@pytest.mark.parametrize(
    ("path", "field"),
    [
        ("spec.distributed.gpus", "$.spec.distributed"),
        ("spec.replicas", "$.spec"),
        ("metadata.labels", "$.metadata"),
    ],
)
def test_unknown_fields_are_refused_naming_them(path: str, field: str) -> None:
    error = parse_refused(with_change(path, 3))
    assert path.rsplit(".", 1)[-1] in error.message
    assert field in error.message


def test_missing_required_field_is_named() -> None:
    doc = yaml.safe_load(yaml.safe_dump(GOOD))
    del doc["spec"]["distributed"]
    error = parse_refused(yaml.safe_dump(doc))
    assert "distributed" in error.message


def test_the_error_field_is_the_bare_json_path() -> None:
    # The same `field` shape admission uses ("$.spec.env"), so clients can match on it.
    error = parse_refused(with_change("spec.distributed.members", 9))
    assert error.field == "$.spec.distributed.members"


def test_deeply_nested_yaml_is_a_clear_error_not_a_crash() -> None:
    parse_refused("spec: " + "[" * 1000 + "]" * 1000)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=300))
def test_any_text_parses_or_is_refused_with_nodus_error(text: str) -> None:
    try:
        parsed = parse_job(text)
    except NodusError as error:
        assert error.code is ErrorCode.INVALID
    else:
        assert isinstance(parsed, Job)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 100) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=12,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.sampled_from(
        [
            "metadata",
            "metadata.name",
            "spec",
            "spec.command",
            "spec.env",
            "spec.image",
            "spec.image.env",
            "spec.distributed",
            "spec.distributed.members",
            "spec.distributed.network",
            "spec.accelerators",
            "spec.accelerators.model",
        ]
    ),
    json_values,
)
def test_any_value_anywhere_parses_or_is_refused_with_nodus_error(path: str, value: Any) -> None:
    try:
        parse_job(with_change(path, value))
    except NodusError as error:
        assert error.code is ErrorCode.INVALID

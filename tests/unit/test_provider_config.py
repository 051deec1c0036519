"""The remediator's `providers:` config (R18): what it accepts, and a clear error naming the
file and the field for what it does not (S3); BMC credentials from their own file."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from libs.contracts.errors import NodusError
from libs.contracts.providers import DEFAULT_POOL, ProviderKind
from libs.contracts.remediation import Action
from services.remediator.providers.config import LAB_CONFIG, load_config, load_credentials

GOOD = """
providers:
  "*": {kind: local}
  h100:
    kind: redfish
    actions: {Reboot: inband, Migrate: exec, Delete: exec}
    redfish:
      bmcs:
        gpu-01: https://10.1.0.1
        gpu-02: {address: "https://10.1.0.2", system: /redfish/v1/Systems/1}
      credentialsFile: /etc/nodus/bmc.yaml
      verifyTls: /etc/nodus/bmc-ca.pem
      offSeconds: 15
    exec:
      commands:
        Migrate: [/usr/local/bin/nodus-migrate, --fast]
        Delete: [/usr/local/bin/open-rma-ticket]
      timeoutSeconds: 600
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "remediator.yaml"
    path.write_text(text)
    return path


def test_a_pool_mixes_providers_per_action(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, GOOD))
    pool = config.providers["h100"]
    assert pool.kind_for(Action.POWER_CYCLE) is ProviderKind.REDFISH
    assert pool.kind_for(Action.REBOOT) is ProviderKind.INBAND
    assert pool.kind_for(Action.DELETE) is ProviderKind.EXEC
    assert pool.redfish is not None and pool.redfish.verify_tls == "/etc/nodus/bmc-ca.pem"
    assert config.providers[DEFAULT_POOL].kind is ProviderKind.LOCAL


def test_no_file_and_an_empty_file_are_the_lab(tmp_path: Path) -> None:
    assert load_config(None) == LAB_CONFIG
    assert load_config(write(tmp_path, "")) == LAB_CONFIG


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("providers: {p: {kind: ipmi}}", "ipmi"),
        (
            "providers: {p: {kind: inband, actions: {Migrate: inband}}}",
            "inband cannot carry out Migrate",
        ),
        ("providers: {p: {kind: redfish}}", "needs a `redfish:` section"),
        (
            "providers: {p: {kind: redfish, redfish: {credentialsFile: /c}}}",
            "bmcs (node -> BMC URL) or addressTemplate",
        ),
        (
            "providers: {p: {kind: redfish, redfish: {credentialsFile: /c, addressTemplate: x}}}",
            "addressTemplate must contain {node}",
        ),
        (
            "providers: {p: {kind: redfish, redfish: {credentialsFile: /c, bmcs: {a: ftp://x}}}}",
            "redfish.bmcs",
        ),
        (
            "providers: {p: {kind: inband, actions: {Migrate: exec}, exec: {commands: {Delete: [x]}}}}",
            "exec.commands has no Migrate",
        ),
        ("providers: {p: {kind: exec}}", "needs an `exec:` section"),
        ("providers: {p: {kind: exec, exec: {commands: {Reprovision: []}}}}", "exec.commands"),
        ("providers: {p: {kind: local, password: hunter2}}", "password"),
        ("providers: [local]", "Expected `object`"),
        ("providers: {p: {kind: local}", "not valid YAML"),
    ],
)
def test_a_bad_config_is_refused_with_its_field(tmp_path: Path, text: str, said: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(NodusError) as refused:
        load_config(path)
    assert str(path) in refused.value.message
    assert said in refused.value.message


def test_credentials_come_from_their_own_file(tmp_path: Path) -> None:
    path = tmp_path / "bmc.yaml"
    path.write_text("username: admin\npassword: s3cret\n")
    assert load_credentials(str(path)).username == "admin"
    path.write_text("username: admin\n")
    with pytest.raises(NodusError) as refused:
        load_credentials(str(path))
    assert "password" in refused.value.message and "s3cret" not in refused.value.message
    with pytest.raises(NodusError, match="No such file"):
        load_credentials(str(tmp_path / "missing.yaml"))


def test_the_shipped_configs_load(tmp_path: Path) -> None:
    """examples/remediator.yaml and the ConfigMap in deploy/kubernetes/remediator.yaml."""
    repo = Path(__file__).resolve().parents[2]
    example = load_config(repo / "examples" / "remediator.yaml")
    assert example.providers["h100"].kind_for(Action.POWER_CYCLE) is ProviderKind.REDFISH
    docs = yaml.safe_load_all((repo / "deploy" / "kubernetes" / "remediator.yaml").read_text())
    [config_map] = [d for d in docs if d and d["kind"] == "ConfigMap"]
    deployed = load_config(write(tmp_path, config_map["data"]["remediator.yaml"]))
    assert deployed.providers[DEFAULT_POOL].kind_for(Action.DELETE) is ProviderKind.EXEC

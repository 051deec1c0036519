"""deploy/ validates: the Kubernetes manifests against the API schemas, offline
(kubernetes-validate); the NATS chart values ask for three replicas, JetStream on disk and TLS;
every daemon has a systemd unit that systemd accepts and whose sandbox systemd rates OK."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
DAEMONS = ["placer", "runner", "relay", "agent", "remediator", "monitor"]
MOST_EXPOSED = 5.0  # systemd-analyze security: up to 5.0 is "OK"


def _manifests() -> list[tuple[str, dict[str, Any]]]:
    found = []
    for path in sorted((DEPLOY / "kubernetes").rglob("*.yaml")):
        if path.name == "nats-values.yaml":
            continue
        found += [(path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return found


def test_every_manifest_is_valid_for_kubernetes() -> None:
    version = kubernetes_validate.utils.latest_version()
    manifests = _manifests()
    kinds = {(str(doc["kind"]), str(doc["metadata"]["name"])) for _, doc in manifests}
    for component in ("placer", "runner", "remediator", "relay"):
        assert ("Deployment", f"nodus-{component}") in kinds
    assert ("DaemonSet", "nodus-agent") in kinds
    for name, doc in manifests:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            raise AssertionError(
                f"{name}: {doc['kind']} {doc['metadata']['name']}: {error}"
            ) from None


def test_relays_spread_across_zones_and_services_run_replicas() -> None:
    by_name = {(d["kind"], d["metadata"]["name"]): d for _, d in _manifests()}
    relay = by_name[("Deployment", "nodus-relay")]["spec"]
    spread = relay["template"]["spec"]["topologySpreadConstraints"]
    assert any(c["topologyKey"] == "topology.kubernetes.io/zone" for c in spread)
    for component in ("placer", "runner", "remediator"):
        assert by_name[("Deployment", f"nodus-{component}")]["spec"]["replicas"] >= 2


def test_each_relay_pod_uses_the_bus_user_of_its_own_node() -> None:
    # Relays are named after their node and their bus users after the relay: one seed for
    # every pod would start one relay and refuse the others.
    by_name = {(d["kind"], d["metadata"]["name"]): d for _, d in _manifests()}
    pod = by_name[("Deployment", "nodus-relay")]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = container["args"]
    assert args[args.index("--name") + 1] == "$(NODE_NAME)"
    env = [e["name"] for e in container["env"]]
    credentials = next(e["value"] for e in container["env"] if e["name"] == "NODUS_CREDENTIALS")
    assert credentials == "/etc/nodus/credentials/$(NODE_NAME).nk"
    # Kubernetes expands $(NODE_NAME) only from a variable defined before it.
    assert env.index("NODE_NAME") < env.index("NODUS_CREDENTIALS")


def test_a_relay_node_runs_a_relay_per_core_each_its_own_and_all_on_443() -> None:
    # deploy/kubernetes/relay-per-core: as nodus-relay@.service, relays of their own (name,
    # mesh port, key, journal, bus user, metrics) sharing the node's 443 for members.
    by_name = {(d["kind"], d["metadata"]["name"]): d for _, d in _manifests()}
    pod = by_name[("Deployment", "nodus-relay-per-core")]["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True
    relays = pod["containers"]
    assert len(relays) >= 2

    def arg(container: dict[str, Any], flag: str) -> str:
        args = container["args"]
        return str(args[args.index(flag) + 1])

    def env(container: dict[str, Any], name: str) -> str:
        return str(next(e["value"] for e in container["env"] if e["name"] == name))

    ports = [arg(c, "--listen").rsplit(":", 1)[1] for c in relays]
    assert [arg(c, "--name") for c in relays] == [f"$(NODE_NAME)-{p}" for p in ports]
    assert [env(c, "NODUS_CREDENTIALS") for c in relays] == [
        f"/etc/nodus/credentials/$(NODE_NAME)-{p}.nk" for p in ports
    ]
    for flag in ("--listen", "--key-file", "--usage-journal", "--metrics-port"):
        assert len({arg(c, flag) for c in relays}) == len(relays), flag
    assert {arg(c, "--share-port") for c in relays} == {"443"}
    # Kubernetes refuses one host port declared twice in a pod: 443 and STUN's are declared once.
    declared = [p.get("hostPort") for c in relays for p in c["ports"] if p.get("hostPort")]
    assert sorted(declared) == sorted({*declared}) and 443 in declared
    mesh = by_name[("ConfigMap", "nodus-relay-per-core")]["data"]["meshWith"].split(",")
    assert {m.rsplit(":", 1)[1] for m in mesh} == set(ports)
    # One user for every relay of the pod: the kernel shares a port only between its sockets.
    assert len({str(c.get("securityContext", {}).get("runAsUser")) for c in relays}) == 1


def test_each_machines_agent_and_monitor_use_their_machines_own_users_and_facts() -> None:
    # Both are confined to one machine: one Secret for every pod would let one machine's
    # agent register and every other's be refused (and each pod could read every seed). The
    # seeds are on each machine, where the systemd units read them too.
    by_name = {(d["kind"], d["metadata"]["name"]): d for _, d in _manifests()}
    pod = by_name[("DaemonSet", "nodus-agent")]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    seeds = {"agent": "nats.nk", "monitor": "monitor.nk"}
    for container in pod["containers"]:
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["NODUS_CREDENTIALS"] == f"/etc/nodus/credentials/{seeds[container['name']]}"
        (mount,) = [
            m for m in container["volumeMounts"] if m["mountPath"] == "/etc/nodus/credentials"
        ]
        assert mount["readOnly"]
        assert volumes[mount["name"]]["hostPath"] == {
            "path": "/etc/nodus/credentials",
            "type": "Directory",
        }
    # What the machine says of itself (region, pool, ...) is its own too, not one for all.
    assert volumes["machine"]["hostPath"] == {"path": "/etc/nodus/machine.yaml", "type": "File"}
    units = {d: (DEPLOY / "systemd" / f"nodus-{d}.service").read_text() for d in seeds}
    assert "LoadCredential=nats.nk:/etc/nodus/credentials/nats.nk" in units["agent"]
    assert "LoadCredential=nats.nk:/etc/nodus/credentials/monitor.nk" in units["monitor"]


def test_the_nats_chart_values_ask_for_a_tls_cluster_of_three_with_jetstream() -> None:
    values = yaml.safe_load((DEPLOY / "kubernetes" / "nats-values.yaml").read_text())["config"]
    assert values["cluster"]["enabled"] and values["cluster"]["replicas"] == 3
    assert values["cluster"]["tls"]["enabled"] and values["nats"]["tls"]["enabled"]
    assert values["jetstream"]["enabled"] and values["jetstream"]["fileStore"]["enabled"]


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")
def test_every_daemon_has_a_unit_systemd_accepts_and_rates_ok(tmp_path: Path) -> None:
    units = sorted((DEPLOY / "systemd").glob("*.service"))
    daemons = [u.stem.removeprefix("nodus-") for u in units if "@" not in u.stem]
    assert sorted(daemons) == sorted(DAEMONS)
    # Templates are checked as an instance: nodus-relay@4431, one more relay on a host.
    templates = [u.stem for u in units if "@" in u.stem]
    assert templates == ["nodus-relay@"]
    nodus = str(Path(sys.executable).parent / "nodus")  # the units name /opt/nodus/bin/nodus
    copies = []
    for unit in units:
        instance = tmp_path / unit.name.replace("@.", "@4431.")
        instance.write_text(unit.read_text().replace("/opt/nodus/bin/nodus", nodus))
        copies.append(str(instance))
    verified = subprocess.run(
        ["systemd-analyze", "verify", *copies], capture_output=True, text=True
    )
    assert verified.returncode == 0, verified.stderr
    for copy in copies:
        rated = subprocess.run(
            ["systemd-analyze", "security", "--offline=true", copy], capture_output=True, text=True
        )
        match = re.search(r"Overall exposure level for \S+: ([0-9.]+)", rated.stdout)
        assert match is not None, rated.stdout[-500:] + rated.stderr
        assert float(match.group(1)) <= MOST_EXPOSED, (copy, match.group(0))

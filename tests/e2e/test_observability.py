"""O3 against a live `nodus up --prometheus` while a Relayed job moves bytes through the relays:
promtool accepts the alert rules and both Prometheus configs, Prometheus loads the rules, every
metric a dashboard panel or a rule names is exported by some daemon, and every panel's query
has data (the relays' bytes for the job's gang, above 0)."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from app.local import REPO, RULES
from app.observability.dashboards import expressions
from libs.client.client import Client
from libs.contracts.jobs import Phase
from tests.e2e import relayed_lab
from tests.e2e.relayed_lab import new_system
from tests.factories import job

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("promtool") is None, reason="deploy/dev/system-deps.sh"),
]

NAME = re.compile(r"\bnodus_[a-z0-9_]+")
HISTOGRAM_PARTS = ("_bucket", "_sum", "_count")


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return json.loads(answer.read())


def _exported(groups: list[dict[str, Any]]) -> set[str]:
    """Every metric family some daemon declares on its /metrics (`# TYPE` lines)."""
    names = set()
    for group in groups:
        [target] = group["targets"]
        with urllib.request.urlopen(f"http://{target}/metrics", timeout=5) as answer:
            for line in answer.read().decode().splitlines():
                if line.startswith("# TYPE "):
                    names.add(line.split()[2])
    return names


def _named(expr: str) -> set[str]:
    found = set()
    for name in NAME.findall(expr):
        for part in HISTOGRAM_PARTS:
            if name.endswith(part):
                name = name.removesuffix(part)
        found.add(name)
    return found


def _rule_exprs() -> list[str]:
    document = yaml.safe_load(RULES.read_text())
    return [rule["expr"] for group in document["groups"] for rule in group["rules"]]


def test_rules_dashboards_and_metrics_agree_on_a_live_system(tmp_path: Path) -> None:
    checked = subprocess.run(
        ["promtool", "check", "rules", str(RULES)], capture_output=True, text=True
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    deploy = REPO / "deploy" / "prometheus" / "prometheus.yml"
    checked = subprocess.run(
        ["promtool", "check", "config", "--syntax-only", str(deploy)],
        capture_output=True,
        text=True,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr

    system = new_system(tmp_path, relayed_lab.fleet("ob", 61))
    system.prometheus = True
    try:
        asyncio.run(system.start(timeout=90))
        generated = system.state_dir / "prometheus" / "prometheus.yml"
        checked = subprocess.run(
            ["promtool", "check", "config", str(generated)], capture_output=True, text=True
        )
        assert checked.returncode == 0, checked.stdout + checked.stderr

        async def run_job() -> str:
            client = await Client.connect(system.url)
            try:
                spec = job(
                    "watched",
                    org="acme",
                    command=["python3", "examples/workloads/allreduce.py"],
                    env={"ALLREDUCE_MIB": "16", "ALLREDUCE_ITERS": "40"},
                    accelerators={"model": "L4"},
                    distributed={"members": 2, "transport": "Auto"},
                )
                await client.apply(spec)
                deadline = time.monotonic() + 120
                while (current := await client.get_job("watched", "acme")).status.phase not in (
                    Phase.RUNNING,
                    Phase.SUCCEEDED,
                ):
                    assert time.monotonic() < deadline, current.status
                    await asyncio.sleep(0.25)
                assert current.status.gang is not None
                assert current.status.gang.transport.value == "relayed"
                return current.key
            finally:
                await client.close()

        gang = asyncio.run(run_job())
        api = f"http://127.0.0.1:{system.prometheus_port}/api/v1"

        def query(expr: str) -> list[dict[str, Any]]:
            expr = expr.replace("$__rate_interval", "5m")
            answer = _get(f"{api}/query?query={urllib.parse.quote(expr)}")
            assert answer["status"] == "success", (expr, answer)
            return list(answer["data"]["result"])

        sent = 'sum by (gang) (max_over_time(nodus_relay_bytes_total{direction="in"}[5m]))'
        deadline = time.monotonic() + 90
        while not any(
            r["metric"].get("gang") == gang and float(r["value"][1]) > 0 for r in query(sent)
        ):
            assert time.monotonic() < deadline, (
                f"Prometheus never saw {gang}'s relay bytes: {query(sent)}; "
                f"{query('nodus_relay_bytes_total')[:4]}; {query('up')}"
            )
            time.sleep(1)

        rules = _get(f"{api}/rules")["data"]["groups"]
        loaded = [r for g in rules for r in g["rules"]]
        assert len(loaded) == len(_rule_exprs()) and all(r["health"] == "ok" for r in loaded), (
            loaded
        )

        groups = json.loads((system.state_dir / "prometheus" / "targets.json").read_text())
        exported = _exported(groups)
        named = set().union(*(_named(e) for e in [*expressions(), *_rule_exprs()]))
        assert named - exported == set(), f"named but exported by no daemon: {named - exported}"

        deadline = time.monotonic() + 30  # a gauge set since the last scrape shows after the next
        while empty := [e for e in expressions() if not query(e)]:
            assert time.monotonic() < deadline, f"panels without data: {empty}"
            time.sleep(1)
        deadline = time.monotonic() + 30  # a rate needs two scrapes of the series
        while not any(r["metric"].get("gang") == gang for r in query(expressions()[0])):
            assert time.monotonic() < deadline, query(expressions()[0])
            time.sleep(1)
    finally:
        system.stop()

"""The dashboards in deploy/grafana/ are what app/observability/dashboards.py generates: run
`make dashboards` after changing a panel, and this test holds the files to it."""

from __future__ import annotations

import json

from app.observability.dashboards import DASHBOARDS, DEPLOY, render


def test_the_committed_dashboards_are_the_generated_ones() -> None:
    for name in DASHBOARDS:
        path = DEPLOY / f"{name}.json"
        assert path.read_text() == render(name), f"{path} is stale: run `make dashboards`"
    assert sorted(p.stem for p in DEPLOY.glob("*.json")) == sorted(DASHBOARDS)


def test_every_panel_has_a_query_and_a_unit() -> None:
    for name in DASHBOARDS:
        document = json.loads(render(name))
        assert document["uid"] == f"nodus-{name}"
        graphs = [p for p in document["panels"] if p["type"] == "timeseries"]
        assert graphs
        for panel in graphs:
            assert panel["targets"][0]["expr"] and panel["targets"][0]["refId"] == "A"
            assert panel["fieldConfig"]["defaults"]["unit"]

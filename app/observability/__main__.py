"""`python -m app.observability`: write deploy/grafana/*.json from app/observability/dashboards.py."""

from app.observability.dashboards import write

for path in write():
    print(path)

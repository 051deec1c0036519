"""What operators watch Nodus with: Grafana dashboards generated as code (dashboards.py) and the
Prometheus alert rules in deploy/prometheus/rules/."""

"""Monitoring as code: the PrometheusRule's promtool checks, the Grafana dashboards' generator,
the local Prometheus scrape config derived from the PodMonitors (components/monitoring)."""

"""Observability: Prometheus metrics and JSON logs."""

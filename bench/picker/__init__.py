"""Benchmarks of the picker: `service` (gRPC decisions/s and latency, scrape CPU; `make
bench-picker`), `scale` (decision cost against pool size, scraping beside decisions, worker
processes; `make bench-picker-scale`) and the Go load client that plays Envoy (`loadclient/`)."""

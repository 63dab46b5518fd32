"""Benchmarks that stay: `python -m bench` runs them and writes BENCHMARKS.md (see bench/README.md)."""

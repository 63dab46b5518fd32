"""Load signals: vLLM /metrics parsing and per-endpoint state (scrapes, in-flight counts)."""

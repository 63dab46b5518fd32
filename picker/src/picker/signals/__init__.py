"""Load signals: vLLM /metrics parsing, per-endpoint state, in-flight counts, the scraper."""

"""Envoy ext_proc endpoint picker for vLLM leaders."""

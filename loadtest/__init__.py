"""Load tests: workloads, vLLM-style metrics, locust users, the http (least request) vs llm-gw (picker) comparison."""

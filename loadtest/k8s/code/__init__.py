"""Load tests: workloads, vLLM-style metrics, locust users, the 8080 vs 8081 comparison."""

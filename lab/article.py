"""The reference article's measured table (REFERENCE.md §10): port 8080 = Envoy Gateway least
request, 8081 = the endpoint picker; QwQ-32B on 3 groups of 2 x 2 A10, 300 prompts, concurrency 30.
The one place these figures are written; the lab's calibration and BENCHMARKS.md read them here."""

ARTICLE = {
    "least-request": {"mean_ttft_ms": 10909.0, "median_ttft_ms": 2446.0, "p99_ttft_ms": 119309.0,
                      "mean_tpot_ms": 114.2, "output_throughput": 227.6, "duration": 2362.7},
    "picker": {"mean_ttft_ms": 7336.0, "median_ttft_ms": 2413.0, "p99_ttft_ms": 106624.0,
               "mean_tpot_ms": 117.3, "output_throughput": 231.5, "duration": 2325.1},
}

"""Live per-port statistics for the web UI: the same numbers as the result JSON."""
import numpy as np

from loadtest.live import port_row, series, table_structure
from loadtest.metrics import RequestSample, parse_goodput, parse_percentiles, summarize


def sample(start, ttft, n=5, gap=0.01, ok=True):
    return RequestSample(start=start, success=ok, ttft=ttft, latency=ttft + gap * (n - 1),
                         itl=[gap] * (n - 1), output_tokens=n, prompt_tokens=3,
                         end=start + ttft + gap * (n - 1), target="8081",
                         error="" if ok else "HTTP 500")


def test_row_matches_the_result_json_and_counts_goodput():
    samples = [sample(i * 0.5, 0.1 + i * 0.05) for i in range(20)] + [sample(3, 0, ok=False)]
    slos = parse_goodput("ttft:500")
    row = port_row("8081", samples, "running (phase 2/2)", (50, 95), slos)
    result = summarize(samples, percentiles=(50, 95), goodput=slos)
    assert row["port"] == "8081/llm-gw = picker" and row["state"] == "running (phase 2/2)"
    assert row["requests"] == 21 and row["failures"] == 1
    assert row["ttftp95"] == round(result["p95_ttft_ms"], 1)
    assert row["e2elmean"] == round(result["mean_e2el_ms"], 1)
    assert row["goodput"] == round(result["request_goodput"], 3) and 0 < row["goodput"] < row["rps"]
    keys = [c["key"] for c in table_structure((50, 95), True)]
    assert set(row) == set(keys)


def test_series_bins_by_finish_time_from_the_phase_start():
    samples = [sample(100 + i, 0.1 * (i + 1)) for i in range(10)]
    out = series(samples, t0=100, percentiles=(50,), bins=5)
    assert out["ttft"]["t"] == sorted(out["ttft"]["t"]) and len(out["ttft"]["t"]) == 5
    assert np.isclose(out["ttft"]["p50"][0], 150.0)  # first bin: TTFTs 100 and 200 ms
    assert parse_percentiles("") == (99.0,)

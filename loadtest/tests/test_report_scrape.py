from loadtest.report import change_pct, comparison_table
from loadtest.scrape import metrics_url, parse_load

VLLM_TEXT = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="qwq"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="qwq"} 2.0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="qwq"} 0.25
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.1",model_name="qwq"} 4.0
"""


def test_parse_load_reads_vllm_gauges_including_old_kv_name():
    assert parse_load(VLLM_TEXT) == {"running": 3.0, "waiting": 2.0, "kv_usage": 0.25}
    both = VLLM_TEXT + ('# TYPE vllm:kv_cache_usage_perc gauge\n'
                        'vllm:kv_cache_usage_perc{engine="0",model_name="qwq"} 0.5\n'
                        'vllm:kv_cache_usage_perc{engine="1",model_name="qwq"} 0.3\n')
    assert parse_load(both)["kv_usage"] == 0.4   # new name wins, averaged over engines
    assert metrics_url("127.0.0.1:8101") == "http://127.0.0.1:8101/metrics"
    assert metrics_url("http://h:1/metrics") == "http://h:1/metrics"


def test_comparison_table_has_article_rows_and_changes():
    base = {"mean_ttft_ms": 10909.0, "median_ttft_ms": 2446.0, "p99_ttft_ms": 119309.0,
            "mean_tpot_ms": 114.2, "total_token_throughput": 656.83, "output_throughput": 227.63}
    new = {"mean_ttft_ms": 7336.0, "median_ttft_ms": 2413.0, "p99_ttft_ms": 106624.0,
           "mean_tpot_ms": 117.3, "total_token_throughput": 667.60, "output_throughput": 231.46}
    table = comparison_table({"8080": base, "8081": new})
    lines = {line.split("|")[1].strip(): line for line in table.splitlines()}
    assert "| 10,909.0 | 7,336.0 | -32.8 % |" in lines["Mean TTFT (ms)"]
    assert "-10.6 %" in lines["P99 TTFT (ms)"] and "+2.7 %" in lines["Mean TPOT (ms)"]
    assert "+1.6 %" in lines["Total token throughput (tok/s)"]
    assert "| - | - | - |" in lines["Mean ITL (ms)"]  # missing values are shown as "-"
    assert change_pct(0.0, 5.0) == "-"

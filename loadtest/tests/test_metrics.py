import json
import math

import numpy as np
import pytest

from loadtest.metrics import (RESULT_KEYS, StreamTimer, percent_change, read_samples, run_duration,
                              save_run, summarize, summary_keys, write_samples)


def chunk(text="x"):
    return {"choices": [{"index": 0, "text": text}]}


def timed_sample(chunk_times, completion_tokens, prompt_tokens=10, start=100.0):
    timer = StreamTimer(start_wall=start, start_mono=0.0, prompt_tokens=999)
    for t in chunk_times:
        timer.on_event(chunk(), t)
    timer.on_event({"choices": [], "usage": {"prompt_tokens": prompt_tokens,
                                             "completion_tokens": completion_tokens}},
                   chunk_times[-1] + 0.5)
    return timer.finish(chunk_times[-1] + 0.6)


def test_stream_timer_follows_vllm_definitions():
    s = timed_sample([0.2, 0.3, 0.5, 0.6], completion_tokens=4)
    assert s.success and s.ttft == pytest.approx(0.2)
    assert s.itl == pytest.approx([0.1, 0.2, 0.1])
    # E2EL ends at the last choices chunk, not at the usage chunk or the stream end
    assert s.latency == pytest.approx(0.6)
    assert s.tpot == pytest.approx((0.6 - 0.2) / 3)
    assert (s.prompt_tokens, s.output_tokens) == (10, 4)  # from usage, not the workload
    assert s.end == pytest.approx(100.0 + 1.2)


def test_first_chunk_with_empty_text_counts_for_ttft_but_empty_choices_do_not():
    timer = StreamTimer(0.0, 0.0)
    timer.on_event({"choices": []}, 0.1)          # role-only / keep-alive: no choices
    timer.on_event(chunk(text=""), 0.3)           # empty text, non-empty choices
    timer.on_event(chunk(), 0.4)
    s = timer.finish(0.5)
    assert s.ttft == pytest.approx(0.3) and s.output_tokens == 2  # no usage: chunk count


def test_failures_keep_reason_and_are_excluded_from_stats():
    ok = timed_sample([1.0, 2.0, 3.0], completion_tokens=3)
    failed = StreamTimer(100.0, 0.0).finish(5.0, error="HTTP 503: no endpoint")
    empty = StreamTimer(100.0, 0.0).finish(5.0)
    assert not failed.success and failed.error == "HTTP 503: no endpoint"
    assert not empty.success and "without any choices" in empty.error
    r = summarize([ok, failed, empty], duration=10.0)
    assert r["completed"] == 1 and r["failed"] == 2
    assert r["mean_ttft_ms"] == pytest.approx(1000.0)
    assert r["total_output_tokens"] == 3 and r["output_throughput"] == pytest.approx(0.3)


def test_summary_matches_numpy_on_known_values():
    samples = [timed_sample([t0, t0 + g, t0 + 2 * g], completion_tokens=3, prompt_tokens=5)
               for t0, g in [(0.1, 0.05), (0.4, 0.1), (1.0, 0.2), (2.0, 0.01)]]
    single = timed_sample([0.7], completion_tokens=1, prompt_tokens=5)  # no TPOT for 1 token
    r = summarize(samples + [single], duration=4.0, percentiles=(50, 99, 99.9))
    ttfts = np.array([0.1, 0.4, 1.0, 2.0, 0.7]) * 1000
    tpots = np.array([0.05, 0.1, 0.2, 0.01]) * 1000
    itls = np.repeat([0.05, 0.1, 0.2, 0.01], 2) * 1000
    assert r["mean_ttft_ms"] == pytest.approx(ttfts.mean())
    assert r["median_ttft_ms"] == pytest.approx(np.median(ttfts))
    assert r["std_ttft_ms"] == pytest.approx(ttfts.std())
    assert r["p99_ttft_ms"] == pytest.approx(np.percentile(ttfts, 99))
    assert r["p99.9_itl_ms"] == pytest.approx(np.percentile(itls, 99.9))
    assert r["mean_tpot_ms"] == pytest.approx(tpots.mean())
    assert r["median_itl_ms"] == pytest.approx(np.median(itls))
    assert r["total_input_tokens"] == 25 and r["total_output_tokens"] == 13
    assert r["request_throughput"] == pytest.approx(5 / 4.0)
    assert r["total_token_throughput"] == pytest.approx(38 / 4.0)


def test_empty_run_gives_zeros_not_errors():
    r = summarize([], duration=0.0)
    assert r["completed"] == 0 and r["mean_ttft_ms"] == 0.0
    assert math.isnan(r["request_throughput"])


def test_samples_roundtrip_and_duration(tmp_path):
    a = timed_sample([0.2, 0.4], completion_tokens=2, start=10.0)
    b = timed_sample([0.5, 0.9], completion_tokens=2, start=11.0)
    write_samples(tmp_path / "s.jsonl", [a, b])
    back = read_samples(tmp_path / "s.jsonl")
    assert back == [a, b]
    assert run_duration(back) == pytest.approx(11.0 + 1.5 - 10.0)


def test_save_run_writes_result_samples_and_per_port_numbers(tmp_path):
    a = timed_sample([0.1, 0.2], completion_tokens=2)
    a.target = "8080"
    b = timed_sample([0.3, 0.4], completion_tokens=2)
    b.target = "8081"
    bad = StreamTimer(100.0, 0.0, target="8081").finish(1.0, error="HTTP 429: shed")
    result = save_run(tmp_path / "run-1", [a, b, bad], model_id="qwq")
    on_disk = json.loads((tmp_path / "run-1.json").read_text())
    assert on_disk == result and result["model_id"] == "qwq"
    assert result["errors_by_reason"] == {"HTTP 429: shed": 1}
    assert result["by_target"]["8080"]["mean_ttft_ms"] == pytest.approx(100.0)
    assert result["by_target"]["8081"]["failed"] == 1
    assert len(read_samples(tmp_path / "run-1.samples.jsonl")) == 3


def test_result_keys_are_summary_fields_and_subsets_keep_their_order():
    result = summarize([timed_sample([0.2, 0.3, 0.5], completion_tokens=3)])
    assert set(RESULT_KEYS) <= set(result)
    assert summary_keys("failed", "mean_ttft_ms") == ("mean_ttft_ms", "failed")
    with pytest.raises(ValueError, match="not result keys: mean_ttft"):
        summary_keys("mean_ttft")


def test_percent_change_is_relative_to_the_base():
    assert percent_change(200.0, 150.0) == pytest.approx(-25.0)
    assert percent_change(0.0, 5.0) is None and percent_change(None, 5.0) is None
    assert percent_change(float("nan"), 5.0) is None and percent_change(5.0, None) is None

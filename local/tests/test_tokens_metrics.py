"""Tokenizer convention and the /metrics exposition."""

import zlib

from prometheus_client.parser import text_string_to_metric_families

from local.sim.engine import Engine
from local.sim.engines import TINY
from local.sim.metrics import cache_config_labels, render_gauges, render_metrics
from local.sim.tokens import chat_token_ids, count_tokens, token_ids


def test_one_word_one_stable_token():
    assert count_tokens("  alpha beta\n gamma ") == 3
    assert token_ids("alpha beta") == [token_ids("alpha")[0], token_ids("beta")[0]]
    assert token_ids("alpha") == [zlib.crc32(b"alpha")] == [3504355690]  # CRC-32, stable across processes


def test_chat_prompt_counts_content_framing_and_reply_primer():
    msgs = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hello there you"}]}]
    assert len(chat_token_ids(msgs)) == 5 + 2 * 5 + 3   # content words, 5 per message, 3 for the reply


def families(text):
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_metrics_names_types_labels_and_values():
    t = [0.0]
    engine = Engine(TINY, lambda: t[0])
    engine.add_request("a", list(range(8)), max_tokens=2)
    engine.add_request("b", list(range(100, 108)), max_tokens=2)
    result = engine.step()
    t[0] = result.end_time
    fams = families(render_metrics(engine, "qwq"))
    assert fams["vllm:num_requests_running"].type == "gauge"
    assert fams["vllm:num_requests_running"].samples[0].value == 2
    assert fams["vllm:num_requests_running"].samples[0].labels == {"model_name": "qwq",
                                                                  "engine": "0"}
    assert fams["vllm:kv_cache_usage_perc"].samples[0].value == 4 / 16
    assert "vllm:gpu_cache_usage_perc" not in fams     # removed from vLLM (0.32 has none)
    info = fams["vllm:cache_config_info"].samples[0]
    assert info.labels["block_size"] == "4" and info.labels["num_gpu_blocks"] == "16"
    assert fams["vllm:prompt_tokens"].type == "counter"
    assert fams["vllm:prompt_tokens"].samples[0].value == 16
    assert fams["vllm:generation_tokens"].samples[0].value == 2
    assert fams["vllm:prefix_cache_queries"].samples[0].name == "vllm:prefix_cache_queries_total"
    ttft = fams["vllm:time_to_first_token_seconds"]
    assert ttft.type == "histogram"
    count = [s for s in ttft.samples if s.name.endswith("_count")][0]
    assert count.value == 2
    for name in ("vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:num_preemptions", "vllm:prefix_cache_hits", "vllm:num_requests_waiting",
                 "vllm:request_success"):
        assert name in fams


def test_gauges_only_and_snapshot_render_agree():
    engine = Engine(TINY, lambda: 0.0)
    engine.add_request("a", list(range(8)), max_tokens=2)
    engine.step()
    quick = render_metrics(engine, "qwq", gauges_only=True)
    assert "histogram" not in quick and "vllm:num_requests_running" in quick
    assert quick == render_gauges("qwq", 1, 0, engine.kv_cache_usage(),
                                  cache_config_labels(engine))


def test_gauge_pages_from_the_template_equal_prometheus_client_renders():
    import random
    from local.sim.metrics import render_gauges_slow
    rng = random.Random(5)
    config = cache_config_labels(Engine(TINY, lambda: 0.0))
    values = [(0, 0, 0.0), (1, 0, 1.0), (3, 2, 1e-07), (256, 9999999, 0.5555555555)]
    values += [(rng.randrange(300), rng.randrange(10**rng.randrange(1, 9)),
                rng.randrange(2351) / 2350) for _ in range(300)]
    for model in ("qwq", 'odd "name" {with} braces'):
        for running, waiting, kv in values:
            assert render_gauges(model, running, waiting, kv, config) == \
                render_gauges_slow(model, running, waiting, kv, config)


def test_filler_word_ids_are_the_ids_of_the_words_the_server_streams():
    import random
    from local.sim.tokens import filler_word, filler_word_id, filler_word_ids, word_id
    rng = random.Random(1)
    for _ in range(2000):
        seed, start = rng.getrandbits(32), rng.randrange(50_000)
        stop = start + rng.randrange(40)
        want = [word_id(filler_word(seed, i)) for i in range(start, stop)]
        assert list(filler_word_ids(seed, start, stop)) == want
        assert [filler_word_id(seed, i) for i in range(start, stop)] == want

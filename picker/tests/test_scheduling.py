"""Each scorer, filter and picker, the profiles, the prefix index and the rewrite choice."""
import random
from collections import Counter

import pytest

from picker.discovery.objects import Rewrite, RewriteRule
from picker.scheduling import scorers
from picker.scheduling.context import SchedulingContext
from picker.scheduling.filters import kv_headroom_filter, saturation_filter
from picker.scheduling.pickers import max_score_picker
from picker.scheduling.prefix import PrefixIndex, block_hashes
from picker.scheduling.profile import builtin_profiles, load_profile, profile_from_dict
from picker.scheduling.rewrite import choose_target, find_rule, order_rewrites
from picker.signals.metrics import ModelServerMetrics
from picker.signals.state import EndpointState


def ep(addr, stale=False, **m):
    e = EndpointState(addr, metrics=ModelServerMetrics(models=frozenset({"qwq"}), **m), scraped_at=0.0)
    e.stale = stale
    return e


def ctx(**kw):
    base = dict(target_model="qwq", prompt_tokens=1000, max_tokens=None, priority=0, now=0.0)
    base.update(kw)
    return SchedulingContext(**base)


def test_queue_scorer_min_max_normalised_and_stale_worst():
    eps = [ep("a", waiting=0), ep("b", waiting=4), ep("c", waiting=2), ep("d", stale=True)]
    assert scorers.queue_scorer()(ctx(), eps) == [1.0, pytest.approx(1 / 5), pytest.approx(3 / 5), 0.0]
    assert scorers.queue_scorer()(ctx(), eps[:1] * 2) == [1.0, 1.0]


def test_queue_scorer_counts_requests_sent_since_scrape_when_asked():
    a, b = ep("a", waiting=1), ep("b", waiting=2)
    a.since_scrape = 3
    assert scorers.queue_scorer()(ctx(), [a, b]) == [1.0, 0.0]
    assert scorers.queue_scorer(include_inflight=True)(ctx(), [a, b]) == [0.0, 1.0]


def test_kv_scorer():
    eps = [ep("a", kv_usage=0.25), ep("b", kv_usage=0.9), ep("c", kv_usage=0.1, stale=True)]
    assert scorers.kv_cache_scorer()(ctx(), eps) == [0.75, pytest.approx(0.1), 0.0]
    e = ep("d", kv_usage=0.5, block_size=16, num_gpu_blocks=100)  # 1600 tokens capacity
    e.since_scrape_tokens = 400
    assert scorers.kv_cache_scorer(include_inflight=True)(ctx(), [e]) == [pytest.approx(0.25)]


def test_prefix_scorer_is_share_of_blocks_held():
    c = ctx(hashes=[1, 2, 3, 4], prefix_match={"a": 4, "b": 1})
    assert scorers.prefix_cache_scorer()(c, [ep("a"), ep("b"), ep("c")]) == [1.0, 0.25, 0.0]


def test_inflight_scorer():
    a, b, c = ep("a"), ep("b"), ep("c")
    a.inflight, b.inflight, c.inflight = 0, 10, 5
    assert scorers.inflight_load_scorer()(ctx(), [a, b, c]) == [1.0, 0.0, 0.5]


def test_lora_affinity_scorer_values():
    lora = dict(lora_max=2)
    eps = [ep("active", lora_running=frozenset({"ad"}), **lora),
           ep("free", lora_running=frozenset({"x"}), **lora),
           ep("waiting", lora_running=frozenset({"x", "y"}), lora_waiting=frozenset({"ad"}), **lora),
           ep("full", lora_running=frozenset({"x", "y"}), **lora),
           ep("nolora")]
    assert scorers.lora_affinity_scorer()(ctx(target_model="ad"), eps) == [1.0, 0.8, 0.6, 0.0, 1.0]


def test_predicted_ttft_prefers_cached_prefix_over_slightly_shorter_queue():
    a, b = ep("a", waiting=1), ep("b", waiting=0)
    c = ctx(prompt_tokens=4000, avg_prompt_tokens=500, hashes=list(range(250)),
            prefix_match={"a": 250})
    cost_a = scorers.predicted_ttft_cost(c, a, 16, 8192, 256)
    cost_b = scorers.predicted_ttft_cost(c, b, 16, 8192, 256)
    assert cost_a == 500 and cost_b == 4000
    assert scorers.predicted_ttft_scorer()(c, [a, b])[0] == 1.0


def test_predicted_ttft_miss_weight_keeps_affinity_against_a_longer_queue():
    # a holds 3,000 of the 4,000 prompt tokens but has 4 requests waiting; b is idle and cold.
    a, b = ep("a", waiting=4), ep("b")
    c = ctx(prompt_tokens=4000, avg_prompt_tokens=1000, block_size_tokens=16,
            hashes=list(range(250)), prefix_match={"a": 3000 // 16})
    uncached_a = 4000 - (3000 // 16) * 16
    assert scorers.predicted_ttft_cost(c, a, 0, 8192, 0) == 4000 + uncached_a
    assert scorers.predicted_ttft_cost(c, b, 0, 8192, 0) == 4000
    assert scorers.predicted_ttft_cost(c, a, 0, 8192, 0, miss_weight=3) == 4000 + 3 * uncached_a
    assert scorers.predicted_ttft_cost(c, b, 0, 8192, 0, miss_weight=3) == 12000
    plain = scorers.predicted_ttft_scorer(running_tokens=0)(c, [a, b])
    weighted = scorers.predicted_ttft_scorer(running_tokens=0, miss_weight=3)(c, [a, b])
    assert plain[1] == 1.0 and plain[0] < 1.0
    assert weighted[0] == 1.0 and weighted[1] < 1.0


def test_predicted_ttft_penalises_kv_that_cannot_admit_the_prompt():
    kw = dict(block_size=16, num_gpu_blocks=500)  # 8000 tokens
    full = ep("full", kv_usage=0.8, **kw)            # 1600 free
    roomy = ep("roomy", kv_usage=0.1, waiting=2, **kw)
    c = ctx(prompt_tokens=3000, avg_prompt_tokens=1000)
    assert scorers.predicted_ttft_cost(c, full, 0, 8192, 0) == 3000 + 8192 + 1400
    assert scorers.predicted_ttft_cost(c, roomy, 0, 8192, 0) == 2000 + 3000
    scores = scorers.predicted_ttft_scorer()(c, [full, roomy])
    assert scores[1] == 1.0 and scores[0] < 0.5
    assert scorers.predicted_ttft_scorer()(c, [ep("s", stale=True)]) == [0.0]


def test_saturation_filter_keeps_all_when_all_saturated():
    f = saturation_filter()
    ok, busy, stale = ep("ok", waiting=1), ep("busy", waiting=5), ep("stale", stale=True)
    assert f(ctx(), [ok, busy, stale]) == [ok]
    assert f(ctx(), [busy, stale]) == [busy, stale]


def test_kv_headroom_filter():
    kw = dict(block_size=16, num_gpu_blocks=100)  # 1600 tokens
    roomy, tight = ep("roomy", kv_usage=0.0, **kw), ep("tight", kv_usage=0.9, **kw)
    assert kv_headroom_filter(0)(ctx(prompt_tokens=1000), [roomy, tight]) == [roomy]


def test_max_score_picker_breaks_ties_at_random():
    pick = max_score_picker()
    eps = [ep("a"), ep("b"), ep("c")]
    rng = random.Random(3)
    seen = Counter(pick([1.0, 1.0, 0.5], eps, rng).address for _ in range(200))
    assert set(seen) == {"a", "b"} and min(seen.values()) > 60


def test_block_hashes_chain_and_seed_by_model():
    p = "x" * 64 * 3 + "tail"
    h = block_hashes("m", p, 16, 256)
    assert len(h) == 3
    assert block_hashes("m", "x" * 64 * 2, 16, 256) == h[:2]
    assert block_hashes("other", p, 16, 256) != h
    assert block_hashes("m", "y" + p[1:], 16, 256)[2] != h[2]  # later hashes cover the prefix
    assert len(block_hashes("m", p * 100, 16, 5)) == 5
    assert len(block_hashes("m", "é" * 64 * 2, 16, 256)) == 2  # cut on characters


def test_prefix_index_longest_prefix_and_lru_eviction():
    idx = PrefixIndex(capacity_per_endpoint=4)
    idx.add("a", [1, 2, 3])
    idx.add("b", [1, 9])
    assert idx.match([1, 2, 3, 4]) == {"a": 3, "b": 1}
    idx.add("a", [7, 8])  # capacity 4: evicts 1 (least recently used)
    assert idx.match([1, 2, 3]) == {"b": 1}
    assert idx.size("a") == 4
    idx.remove_endpoint("b")
    assert idx.match([1]) == {}


def test_builtin_profiles_load_and_upstream_matches_reference():
    assert {"default", "upstream-default"} <= set(builtin_profiles())
    up = load_profile("upstream-default")
    assert [(s.name, s.weight) for s in up.scorers] == [
        ("queue", 2.0), ("kv-cache-utilization", 2.0), ("prefix-cache", 3.0)]
    assert up.needs_prefix and up.filters == []
    assert load_profile("default").scorers


def test_profile_errors_name_the_problem(tmp_path):
    with pytest.raises(ValueError, match="unknown scorer 'nope'"):
        profile_from_dict({"scorers": [{"type": "nope"}]})
    with pytest.raises(ValueError, match="bad parameters for scorer 'queue'"):
        profile_from_dict({"scorers": [{"type": "queue", "params": {"wrong": 1}}]})
    with pytest.raises(ValueError, match="unknown profile"):
        load_profile("no-such-profile")
    f = tmp_path / "p.yaml"
    f.write_text("scorers: [{type: queue-scorer, weight: 5}]\npicker: {type: max-score-picker}\n")
    assert load_profile(str(f)).scorers[0].weight == 5.0


def test_rewrite_precedence_and_weighted_choice():
    catch_all = Rewrite("all", (RewriteRule((), (("fallback", 1.0),)),), created="2020-01-01")
    newer = Rewrite("new", (RewriteRule(("qwq",), (("qwq-new", 1.0),)),), created="2024-01-01")
    older = Rewrite("old", (RewriteRule(("qwq",), (("qwq", 90.0), ("qwq-canary", 10.0))),),
                    created="2023-01-01")
    ordered = order_rewrites([newer, catch_all, older])
    rule = find_rule(ordered, "qwq")
    assert rule is older.rules[0]                      # exact beats catch-all; oldest wins
    assert find_rule(ordered, "other") is catch_all.rules[0]
    rng = random.Random(7)
    counts = Counter(choose_target(rule, "qwq", rng) for _ in range(4000))
    assert 0.07 < counts["qwq-canary"] / 4000 < 0.13
    assert choose_target(None, "qwq", rng) == "qwq"


def test_a_cold_burst_sharing_a_new_prefix_spreads_like_least_request():
    """30 requests at once, same new 2,000-token prefix, idle endpoints, no scrape in between:
    with an empty KV cache a prefix miss costs only its own prefill, so the default profile
    spreads the burst (it put 18/12/0 before, upstream-default puts all 30 on one endpoint)."""
    from helpers import body, make_router
    from picker.core import RequestInfo

    router = make_router("default", n=3, num_blocks=4000)
    prefix = " ".join(f"system{i}" for i in range(2000))
    picks = [router.decide(RequestInfo("/v1/completions", {}, body(prompt=f"{prefix} question {i} " + "x " * 200)))
             .endpoint for i in range(30)]
    counts = sorted((picks.count(a) for a in set(picks)), reverse=True)
    assert len(counts) == 3 and counts[0] - counts[-1] <= 2, counts

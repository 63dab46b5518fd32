"""Output lengths: the request features, the online predictor, each endpoint's remaining work."""
from __future__ import annotations

import json
import math
import random

import pytest

from picker.core import RequestInfo, Router, RouterSettings
from picker.lengths.features import MAX_CAP, Features, half_octave
from picker.lengths.predictor import LEVELS, LengthPredictor, PredictorSettings
from picker.lengths.work import EndpointWork, WorkTracker, _play, project
from picker.scheduling.profile import load_profile
from picker.signals.outcomes import Outcome


def feats(client="", template="t", cap=None, prompt=1000, mode="text", model="qwq"):
    return Features(model, client, template, template + "-ctx", half_octave(cap),
                    half_octave(prompt), mode, cap)


# ---- features --------------------------------------------------------------------------------

def test_features_come_from_what_the_request_carries():
    obj = {"model": "qwq", "max_tokens": 4096, "reasoning_effort": "high",
           "chat_template_kwargs": {"enable_thinking": True}, "tools": [{"type": "function"}]}
    f = Features.of("/v1/chat/completions", {"x-client-id": "team-a"}, obj, "qwq", "system: hi",
                    3, 4096, [11, 22, 33])
    assert f.client == "team-a" and f.cap_tokens == 4096 and f.cap == half_octave(4096)
    assert f.mode == "chat,effort=high,think,tools"
    assert f.template == format(22, "x") and f.context == format(33, "x")  # blocks 2 and 16 (or last)
    assert Features.from_key(f.key()) == f


def test_the_same_system_prompt_gives_the_same_template_without_prefix_hashes():
    system = "You are a careful assistant. " * 40
    a = Features.of("/v1/completions", {}, {}, "m", system + "question one", 300, None, [])
    b = Features.of("/v1/completions", {}, {}, "m", system + "another question", 300, None, [])
    c = Features.of("/v1/completions", {}, {}, "m", "Different. " * 60 + "question", 300, None, [])
    assert a.template == b.template != c.template
    assert a.cap == "-" and a.cap_tokens is None


def test_a_foreign_or_damaged_key_is_refused_and_absurd_caps_are_clipped():
    assert Features.from_key("") is None
    assert Features.from_key("a\tb") is None
    assert Features.from_key("m\tc\tt\tx\tnot-a-number\t20\ttext") is None
    f = Features.of("/v1/completions", {"x-client-id": "x\ty"}, {}, "m", "p", 1, 10**30, [])
    assert f.cap_tokens == MAX_CAP and "\t" not in f.client
    assert Features.from_key(f.key()).cap_tokens == MAX_CAP


# ---- the predictor ---------------------------------------------------------------------------

def test_without_history_the_forecast_is_the_default_capped_by_the_request():
    p = LengthPredictor(PredictorSettings(default_length=300))
    assert p.forecast(feats()).median == 300
    assert p.forecast(feats(cap=50)).median == 50 and p.forecast(feats(cap=50)).family == "default"


def lognormal(rng, median, sigma=0.4):
    return max(1, round(median * math.exp(rng.gauss(0, sigma))))


def test_two_clients_ten_times_apart_are_learned_apart_from_the_client_id_alone():
    rng = random.Random(1)
    p = LengthPredictor()
    for i in range(80):
        client = "chat" if i % 2 else "reasoner"
        # same prompt lengths, same cap, a template unique to each request: only the client shows
        f = feats(client=client, template=f"t{i}", cap=8192, prompt=1000)
        p.learn(f, lognormal(rng, 200 if client == "chat" else 2000))
    chat = p.forecast(feats(client="chat", template="new1", cap=8192))
    reasoner = p.forecast(feats(client="reasoner", template="new2", cap=8192))
    assert chat.family.startswith("client") and reasoner.family.startswith("client")
    assert 150 < chat.median < 270 and 1500 < reasoner.median < 2700
    assert reasoner.high > reasoner.median > chat.high


def test_when_nothing_predicts_the_length_the_forecast_is_the_pool_prior():
    rng = random.Random(2)
    p = LengthPredictor()
    for i in range(300):
        f = feats(client=rng.choice("abc"), template=rng.choice("xyz"), prompt=rng.choice((500, 2000)))
        p.learn(f, lognormal(rng, 700, 1.0))
    losses = p.family_losses("qwq")
    # the features carry nothing: none forecasts clearly better than the prior
    assert min(losses.values()) > losses["prior"] - 0.1
    f = p.forecast(feats(client="a", template="x"))
    assert 450 < f.median < 1100


def test_the_high_quantile_covers_about_ninety_percent_of_answers():
    rng = random.Random(3)
    p = LengthPredictor()
    for _ in range(400):
        p.learn(feats(), lognormal(rng, 800, 0.7))
    high = p.forecast(feats()).high
    fresh = [lognormal(rng, 800, 0.7) for _ in range(2000)]
    assert 0.84 < sum(n <= high for n in fresh) / len(fresh) < 0.96


def test_a_key_follows_its_traffic_when_it_changes():
    rng = random.Random(4)
    p = LengthPredictor(PredictorSettings(memory=32))
    for _ in range(200):
        p.learn(feats(client="a"), lognormal(rng, 200))
    for _ in range(100):
        p.learn(feats(client="a"), lognormal(rng, 3000))
    assert p.forecast(feats(client="a")).median > 2000


def test_forecasts_never_exceed_the_cap_and_memory_stays_bounded():
    rng = random.Random(5)
    p = LengthPredictor(PredictorSettings(max_keys=16))
    for i in range(500):
        p.learn(feats(client=f"c{i}", template=f"t{i}"), lognormal(rng, 4000))
    f = p.forecast(feats(client="c499", template="t499", cap=1000))
    assert max(f.quantiles) <= 1000
    tables = p.models["qwq"]
    assert all(len(t) <= 16 for t in tables.families[1:])


def test_residual_work_given_what_was_produced():
    p = LengthPredictor()
    for n in (100, 200, 300, 400, 500, 600, 700, 800) * 20:
        p.learn(feats(), n)
    f = p.forecast(feats())
    assert len(f.quantiles) == len(LEVELS)
    assert f.residual(0) == pytest.approx(f.median)
    assert f.residual(450) < f.residual(0)
    # past every quantile: a long tail, the request keeps going for a while
    assert f.residual(5000) == pytest.approx(1250)


@pytest.mark.parametrize("bad", [dict(memory=1), dict(prior_weight=-1), dict(max_keys=0),
                                 dict(loss_alpha=0), dict(default_length=0)])
def test_bad_predictor_settings_are_refused(bad):
    with pytest.raises(ValueError):
        PredictorSettings(**bad)


# ---- remaining work ----------------------------------------------------------------------------

def test_the_wait_is_the_first_predicted_end_after_which_the_request_fits():
    # 1,000 tokens free; three running requests ending after 10, 50 and 200 steps, holding 3,000,
    # 2,000 and 1,000 tokens; nothing queued.
    p = _play([[10, 3000], [50, 2000], [200, 1000]], [], free=1000, tpot=0.1)
    assert p.first == -1 and p.wait_steps(900) == 0
    assert p.wait_steps(3900) == 10          # 1,000 + 3,000 - 2 x 10 running tokens = 3,980
    assert p.wait_steps(5900) == 50          # + 2,000 - 40 more
    assert p.wait_seconds(5900) == pytest.approx(5.0)
    assert p.wait_steps(50_000) == 200       # never fits: after the last end


def test_the_queue_ahead_is_admitted_first():
    # 500 tokens of prompt waiting ahead: admitted at the first end, it holds KV from then on.
    alone = _play([[10, 3000], [50, 2000]], [], free=1000, tpot=0.1)
    behind = _play([[10, 3000], [50, 2000]], [(2500.0, 100.0)], free=1000, tpot=0.1)
    assert behind.first == 0 and behind.free_at_end[0] == pytest.approx(3990 - 2500)
    assert alone.wait_steps(2000) == 10 and behind.wait_steps(2000) == 50


def test_when_kv_runs_out_the_newest_request_is_preempted():
    # Two requests grow into 100 free tokens: after 50 steps the newest is preempted and goes
    # back to the queue; it is readmitted only after the first end.
    p = _play([[400, 1000], [300, 1000]], [], free=100, tpot=0.1)
    assert p.end_steps[0] == pytest.approx(400)      # the oldest runs to its end
    assert p.free_at_end[0] > 1000                  # and frees all it grew to


def test_the_projection_splits_running_from_waiting_by_arrival_order():
    f = LengthPredictor().forecast(feats(cap=100))      # 100 tokens each
    w = EndpointWork(tpot=0.1, ttft=0.0)
    tracker = WorkTracker()
    tracker.endpoints["e"] = w
    for i, t in enumerate((0.0, 1.0, 2.0)):
        tracker.add(f"r{i}", "e", t, 500, 600, f)
    w.on_scrape(2.0, waiting=1)                          # the newest one waits
    assert [w.entries[r].started_at for r in ("r0", "r1", "r2")] == [2.0, 2.0, None]
    lazy = project(w, now=7.0, capacity=4000, used=1100, running=2, waiting=1, avg_prompt=500,
                   fallback=None)
    assert lazy.wait_steps(100) == 0                   # admitted behind the queued one at once
    proj = lazy._projection()
    # the queued one is admitted at once: 2,900 free less its 500
    assert proj.first == -1 and proj.free_now == pytest.approx(2400)
    # each running one has produced ~50 of its 100 (5 s at 0.1 s a token, less its prefill)
    assert proj.end_steps[0] == pytest.approx(50, abs=1)
    assert len(proj.end_steps) == 3


def test_requests_the_scrape_no_longer_shows_running_have_ended():
    short = LengthPredictor().forecast(feats(cap=10))
    long = LengthPredictor(PredictorSettings(default_length=4000)).forecast(feats())
    w = EndpointWork(tpot=0.1, ttft=0.0)
    tracker = WorkTracker()
    tracker.endpoints["e"] = w
    tracker.add("a", "e", 0.0, 100, 100, short)    # produced ~300 of its 10: surely done
    tracker.add("b", "e", 0.0, 100, 100, long)
    w.on_scrape(0.0, waiting=0)
    lazy = project(w, now=30.0, capacity=10_000, used=500, running=1, waiting=0, avg_prompt=0,
                   fallback=None)
    assert lazy.wait_steps(9000) == 0 and lazy._made is None     # room now: nothing walked
    proj = lazy._projection()
    assert len(proj.end_steps) == 1 and proj.end_steps[0] > 1000    # b's end, not a's


def test_lost_entries_are_reaped_and_finished_ones_removed():
    f = LengthPredictor().forecast(feats())
    tracker = WorkTracker()
    tracker.add("a", "e", 0.0, 10, 10, f)
    tracker.add("b", "e", 100.0, 10, 10, f)
    assert tracker.finish("b").address == "e" and tracker.finish("b") is None
    assert tracker.reap(now=30.0) == 0 and tracker.reap(now=1000.0) == 1
    assert not tracker.by_id and not tracker.endpoints["e"].entries


def test_timings_are_learned_per_endpoint_from_outcomes():
    tracker = WorkTracker()
    tracker.learn_timings("e", ttft=2.0, duration=12.0, completion_tokens=101)
    w = tracker.work("e")
    assert w.tpot == pytest.approx(0.1) and w.ttft == pytest.approx(2.0)
    tracker.learn_timings("e", ttft=None, duration=5.0, completion_tokens=0)   # nothing to learn
    assert w.timed == 1


# ---- in the Router -----------------------------------------------------------------------------

METRICS = """vllm:num_requests_running{model_name="qwq"} 0
vllm:num_requests_waiting{model_name="qwq"} 0
vllm:kv_cache_usage_perc{model_name="qwq"} 0.1
vllm:cache_config_info{block_size="16",num_gpu_blocks="2000"} 1
"""


def routed(router, client, n=1):
    body = json.dumps({"model": "qwq", "prompt": "Tell me about it. " * 30, "max_tokens": 8192})
    return [router.decide(RequestInfo("/v1/completions", {"x-client-id": client}, body.encode()))
            for _ in range(n)]


def outcome(d, tokens, endpoint=None, status=200):
    return Outcome(d.request_id, endpoint or d.endpoint, status, 300, tokens, 1.0,
                   1.0 + (tokens - 1) * 0.05,
                   "", d.target_model, d.features, 0.0)


def make_router(lengths=PredictorSettings()):
    clock = [0.0]
    r = Router(load_profile("default"), clock=lambda: clock[0], rng=random.Random(0),
               settings=RouterSettings(lengths=lengths))
    r.set_endpoints(["10.0.0.1:8000", "10.0.0.2:8000"])
    for a in r.endpoints:
        r.on_scrape_ok(a, METRICS, 0.0)
    return r


def test_the_router_learns_each_clients_answers_from_outcomes():
    r = make_router()
    for i in range(30):
        (a,) = routed(r, "chat")
        (b,) = routed(r, "reasoner")
        assert a.features and a.forecast is not None
        # tracked once outcomes flow (without them an entry could only be reaped)
        assert (a.request_id in r.work.by_id) == (i > 0)
        r.on_outcome(outcome(a, 120))
        r.on_outcome(outcome(b, 2400))
        assert a.request_id not in r.work.by_id and b.request_id not in r.work.by_id
    (a,) = routed(r, "chat")
    (b,) = routed(r, "reasoner")
    assert a.forecast.median < 200 < 1500 < b.forecast.median
    assert r.work.work(a.endpoint).tpot == pytest.approx(0.05)


def test_outcomes_of_other_replicas_teach_too_and_failures_teach_nothing():
    r = make_router()
    other = make_router()
    (d,) = routed(other, "team")
    r.on_outcome(outcome(d, 777))                      # an id this router never issued
    assert r.predictor.learned == 1
    r.on_outcome(outcome(d, 5, status=503))
    r.on_outcome(Outcome("", "10.0.0.1:8000", 200, 1, 5, None, 1.0, "", "qwq", "garbage", 0.0))
    assert r.predictor.learned == 1


def test_with_the_predictor_off_decisions_carry_no_features():
    r = make_router(lengths=None)
    (d,) = routed(r, "team")
    assert d.features == "" and d.forecast is None and not r.work.by_id
    r.on_outcome(outcome(d, 100))     # harmless


def test_forecast_errors_of_own_decisions_reach_the_metrics():
    from picker.config import parser as build_parser
    from picker.observability.metrics import PickerMetrics
    metrics = PickerMetrics()
    r = make_router()
    r.metrics = metrics
    metrics.model_label = r.metric_label
    (first,) = routed(r, "team")
    r.on_outcome(outcome(first, 100))          # outcomes flow: the next decisions are tracked
    (d,) = routed(r, "team")
    r.on_outcome(outcome(d, 400))              # forecast 100 (what it learned), 400 came: 2 off
    text = __import__("prometheus_client").generate_latest(metrics.registry).decode()
    assert 'picker_length_forecast_error_log2_count{family="client",model="qwq"} 1.0' in text \
        or 'picker_length_forecast_error_log2_count{family="prior",model="qwq"} 1.0' in text
    assert 'picker_length_forecast_error_log2_sum' in text
    base = ["--discovery", "static"]
    assert build_parser().parse_args(base + ["--no-lengths"]).lengths is False
    assert build_parser().parse_args(base).lengths is True

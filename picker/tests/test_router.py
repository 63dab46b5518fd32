"""Router.decide end to end over scheduling: errors, rewrite, shedding, staleness, in-flight."""
import json
from collections import Counter

import pytest

from picker.core import PickerError, RequestInfo, RouterSettings
from picker.discovery.objects import Objective, Rewrite, RewriteRule
from picker.observability.metrics import PickerMetrics

from helpers import FakeClock, body, make_router, metrics_text


def req(b, headers=None, subset=None, path="/v1/completions"):
    return RequestInfo(path, headers or {}, b, subset)


def status_of(router, info):
    with pytest.raises(PickerError) as e:
        router.decide(info)
    return e.value.status, e.value.code


def test_picks_least_loaded_and_passes_body_unchanged():
    r = make_router(n=3)
    r.on_scrape_ok("10.0.0.1:8000", metrics_text(waiting=4, kv=0.7))
    r.on_scrape_ok("10.0.0.2:8000", metrics_text(waiting=0, kv=0.1))
    r.on_scrape_ok("10.0.0.3:8000", metrics_text(waiting=2, kv=0.5))
    b = body()
    d = r.decide(req(b))
    assert d.endpoint == "10.0.0.2:8000" and d.body is b
    assert (d.model, d.target_model) == ("qwq", "qwq")


@pytest.mark.parametrize("raw,code", [
    (b"{not json", "invalid_json"), (b"[1,2]", "invalid_type"), (b'{"prompt":"x"}', "missing_model"),
    (b'{"model":5}', "invalid_type"), (b'{"model":"qwq","messages":"hi"}', "invalid_type"),
    (b'{"model":"qwq","max_tokens":"9"}', "invalid_type"), (b'{"model":"qwq","stream":1}', "invalid_type"),
    (b'{"model":"qwq","prompt":{"a":1}}', "invalid_type"), (b'\xff\xfe{"model"', "invalid_utf8"),
    (b"[" * 100000, "invalid_json"),
])
def test_bad_bodies_are_400(raw, code):
    assert status_of(make_router(), req(raw)) == (400, code)


def test_body_over_limit_is_413():
    r = make_router(settings=RouterSettings(max_body_bytes=100))
    assert status_of(r, req(body(prompt="x" * 200))) == (413, "body_too_large")


def test_unknown_model_is_404_and_no_ready_endpoint_is_503():
    r = make_router()
    assert status_of(r, req(body(model="llama"))) == (404, "model_not_found")
    empty = make_router(scrape=False)
    assert status_of(empty, req(body())) == (503, "no_ready_endpoint")


def test_failed_scrape_takes_endpoint_out_until_it_answers():
    r = make_router(n=2)
    r.on_scrape_failed("10.0.0.1:8000")
    assert {r.decide(req(body())).endpoint for _ in range(20)} == {"10.0.0.2:8000"}
    r.on_scrape_failed("10.0.0.2:8000")
    assert status_of(r, req(body()))[0] == 503
    r.on_scrape_ok("10.0.0.2:8000", metrics_text())
    assert r.decide(req(body())).endpoint == "10.0.0.2:8000"


def test_stale_metrics_count_as_saturated():
    clock = FakeClock()
    r = make_router(n=2, clock=clock, settings=RouterSettings(staleness=1.0))
    clock.t += 0.5
    r.on_scrape_ok("10.0.0.2:8000", metrics_text(waiting=3, kv=0.6))
    clock.t += 0.7  # endpoint 1's metrics are now 1.2 s old: stale despite showing an idle server
    assert r.decide(req(body())).endpoint == "10.0.0.2:8000"


def test_subset_hint_restricts_and_empty_subset_is_503():
    r = make_router(n=3)
    seen = {r.decide(req(body(), subset=["10.0.0.3:8000"])).endpoint for _ in range(10)}
    assert seen == {"10.0.0.3:8000"}
    assert status_of(r, req(body(), subset=["10.9.9.9:1"])) == (503, "no_endpoint_in_subset")


def test_bodiless_request_goes_to_any_ready_endpoint():
    r = make_router(n=3)
    r.on_scrape_failed("10.0.0.1:8000")
    seen = Counter(r.decide(req(None, path="/v1/models")).endpoint for _ in range(60))
    assert set(seen) == {"10.0.0.2:8000", "10.0.0.3:8000"}


def test_rewrite_changes_body_and_picks_only_target_servers():
    rw = Rewrite("canary", (RewriteRule(("qwq",), (("qwq-canary", 1.0),)),))
    r = make_router(n=3, rewrites=[rw])
    r.on_scrape_ok("10.0.0.3:8000", metrics_text(model="qwq-canary", waiting=9))
    d = r.decide(req(body(prompt="p", max_tokens=5)))
    assert d.endpoint == "10.0.0.3:8000"
    assert json.loads(d.body) == {"model": "qwq-canary", "prompt": "p", "max_tokens": 5}
    assert (d.model, d.target_model) == ("qwq", "qwq-canary")


def test_a_request_decided_again_reuses_its_parsed_body_and_hashes(monkeypatch):
    """Flow control decides a held request again whenever the signals change: the body is
    parsed and the prefix hashed once per request, and the decisions are those of a fresh one."""
    import picker.core as core
    calls = Counter()
    for name in ("parse_body", "block_hashes"):
        real = getattr(core, name)
        monkeypatch.setattr(core, name, lambda *a, _real=real, _name=name:
                            calls.update([_name]) or _real(*a))
    rw = Rewrite("canary", (RewriteRule(("qwq",), (("qwq-canary", 1.0),)),))
    again, fresh = make_router(n=3, rewrites=[rw]), make_router(n=3, rewrites=[rw])
    for r in (again, fresh):
        r.on_scrape_ok("10.0.0.3:8000", metrics_text(model="qwq-canary", waiting=1))
    held = req(body(prompt="p " * 400, max_tokens=5))
    for _ in range(3):
        d = again.decide(held)
        want = fresh.decide(req(held.body))
        assert (d.endpoint, d.body, d.cached_tokens) == (want.endpoint, want.body, want.cached_tokens)
        assert json.loads(d.body)["model"] == "qwq-canary"
    assert held.parsed.obj["model"] == "qwq"           # the rewrite left the parsed body alone
    assert calls == {"parse_body": 4, "block_hashes": 4}   # 1 for `held` + 3 fresh requests


def test_sheddable_request_gets_429_only_when_pool_saturated():
    objs = [Objective("batch", -1), Objective("interactive", 10)]
    r = make_router(n=2, objectives=objs, waiting=5, kv=0.2)   # saturation = 5/5 = 1.0
    assert status_of(r, req(body(), {"x-gateway-inference-objective": "batch"})) == (429, "pool_saturated")
    d = r.decide(req(body(), {"x-gateway-inference-objective": "interactive"}))
    assert d.priority == 10
    calm = make_router(n=2, objectives=objs, waiting=1, kv=0.2)
    assert calm.decide(req(body(), {"x-gateway-inference-objective": "batch"})).priority == -1


def test_default_objective_applies_without_header():
    r = make_router(objectives=[Objective("batch", -1)], waiting=10,
                    settings=RouterSettings(default_objective="batch"))
    assert status_of(r, req(body()))[0] == 429


def test_inflight_counts_spread_a_burst_between_scrapes():
    r = make_router("default", n=4)
    picks = Counter(r.decide(req(body(prompt=f"request {i} " * 50))).endpoint for i in range(40))
    assert max(picks.values()) - min(picks.values()) <= 2
    assert sum(e.inflight for e in r.endpoints.values()) == 40


def test_request_done_and_reap():
    clock = FakeClock()
    r = make_router(n=1, clock=clock, settings=RouterSettings(inflight_timeout=60))
    d1 = r.decide(req(body(), {"x-request-id": "abc"}))
    d2 = r.decide(req(body(), {"x-request-id": "abc"}))
    assert d1.request_id != d2.request_id and d1.client_request_id == "abc"
    state = r.endpoints["10.0.0.1:8000"]
    assert state.inflight == 2
    r.on_request_done(d1.request_id, {"prompt_tokens": 3})
    assert state.inflight == 1
    clock.t += 61
    assert r.reap() == 1 and state.inflight == 0 and not r.inflight


def test_scrape_resets_since_scrape_counts_but_not_inflight():
    r = make_router(n=1)
    d = r.decide(req(body(prompt="y" * 400)))
    state = r.endpoints["10.0.0.1:8000"]
    assert state.since_scrape == 1 and state.since_scrape_tokens == 100
    r.on_scrape_ok("10.0.0.1:8000", metrics_text(running=1))
    assert state.since_scrape == 0 and state.inflight == 1
    r.on_request_done(d.request_id)
    assert state.inflight == 0 and state.since_scrape == 0


def test_prefix_affinity_sends_repeat_prompt_back():
    r = make_router("upstream-default", n=3)
    prompt = "shared system prompt " * 200
    first = r.decide(req(body(prompt=prompt))).endpoint
    again = r.decide(req(body(prompt=prompt + " follow-up")))
    assert again.endpoint == first and again.cached_tokens > 900


def test_set_endpoints_replaces_the_set():
    r = make_router(n=3)
    r.set_endpoints(["10.0.0.2:8000", "10.0.0.9:8000"])
    assert list(r.endpoints) == ["10.0.0.2:8000", "10.0.0.9:8000"]
    assert r.endpoints["10.0.0.2:8000"].ready and not r.endpoints["10.0.0.9:8000"].ready


def test_metrics_count_outcomes():
    m = PickerMetrics()
    r = make_router(metrics=m)
    m.watch_router(r)
    r.decide(req(body()))
    with pytest.raises(PickerError):
        r.decide(req(body(model="nope")))
    reg = m.registry
    assert reg.get_sample_value("picker_requests_total", {"model": "qwq", "target_model": "qwq", "code": "200"}) == 1
    # a name neither configured nor served is counted, but under one label value
    assert reg.get_sample_value("picker_requests_total", {"model": "unknown", "target_model": "unknown", "code": "404"}) == 1
    assert reg.get_sample_value("picker_endpoint_inflight", {"endpoint": "10.0.0.1:8000"}) is not None
    assert reg.get_sample_value("picker_decision_duration_seconds_count") == 2


def test_request_faults_are_reported_before_pool_state():
    empty = make_router(scrape=False, settings=RouterSettings(max_body_bytes=50))
    assert status_of(empty, req(b"{bad")) == (400, "invalid_json")
    assert status_of(empty, req(body(prompt="x" * 100))) == (413, "body_too_large")
    assert status_of(empty, req(body(prompt="x"))) == (503, "no_ready_endpoint")


def test_client_request_ids_cannot_orphan_or_collide():
    """Forged ids (another request's, or the picker's own form ahead of its counter) never
    replace or share another request's in-flight entry."""
    r = make_router(n=1)
    state = r.endpoints["10.0.0.1:8000"]
    d1 = r.decide(req(body()))
    n = int(d1.request_id.rsplit("-", 1)[1])
    copied = r.decide(req(body(), {"x-request-id": d1.request_id}))
    ahead = r.decide(req(body(), {"x-request-id": f"picker-{n + 2}"}))
    later = [r.decide(req(body())) for _ in range(3)]  # the counter passes the forged value
    decisions = [d1, copied, ahead, *later]
    assert len({d.request_id for d in decisions}) == 6
    assert len(r.inflight) == 6 and state.inflight == 6
    for d in decisions:
        r.on_request_done(d.request_id)
    assert not r.inflight and state.inflight == 0


def test_metric_labels_only_from_known_models():
    m = PickerMetrics()
    r = make_router(metrics=m, rewrites=[Rewrite("any", (RewriteRule((), (("qwq", 1.0),)),)),
                                         Rewrite("alias", (RewriteRule(("qwq-alias",), (("qwq", 1.0),)),))])
    for i in range(50):
        r.decide(req(body(model=f"client-made-{i}")))  # the catch-all rule routes them all
    r.decide(req(body(model="qwq-alias")))
    r.decide(req(body(model="qwq")))
    labels = {s.labels["model"] for s in m.requests.collect()[0].samples}
    assert labels == {"unknown", "qwq-alias", "qwq"}
    rewrites = {s.labels["model"] for s in m.rewrites.collect()[0].samples}
    assert rewrites == {"unknown", "qwq-alias"}


def test_removed_endpoint_drops_its_scrape_error_series():
    m = PickerMetrics()
    r = make_router(n=2, metrics=m)
    r.on_scrape_failed("10.0.0.1:8000")
    r.on_scrape_failed("10.0.0.2:8000")
    r.set_endpoints(["10.0.0.2:8000"])
    endpoints = {s.labels["endpoint"] for s in m.scrape_errors.collect()[0].samples}
    assert endpoints == {"10.0.0.2:8000"}


def test_idle_adapter_listed_in_models_is_routable():
    lora = {"max": 2, "running": ["other"]}
    r = make_router(n=2, lora=lora)
    with pytest.raises(PickerError) as err:
        r.decide(req(body(model="sql-lora")))
    assert err.value.status == 404
    r.on_models("10.0.0.2:8000", ["qwq", "sql-lora"])
    assert r.decide(req(body(model="sql-lora"))).endpoint == "10.0.0.2:8000"


def test_lora_affinity_prefers_a_free_slot_for_an_idle_adapter(tmp_path):
    """Both endpoints list the adapter; it runs on neither; only one has a free adapter slot."""
    profile = tmp_path / "lora.yaml"
    profile.write_text("name: lora\nfilters: []\nscorers: [{type: lora-affinity, weight: 1}]\n"
                       "picker: {type: max-score}\n")
    r = make_router(str(profile), n=2, lora={"max": 1, "running": ["busy"]})
    r.on_scrape_ok("10.0.0.2:8000", metrics_text(lora={"max": 2, "running": ["busy"]}))
    for addr in r.endpoints:
        r.on_models(addr, ["qwq", "sql-lora"])
    picks = {r.decide(req(body(model="sql-lora"))).endpoint for _ in range(20)}
    assert picks == {"10.0.0.2:8000"}


def test_a_request_that_ends_before_the_next_scrape_still_counts_until_that_scrape():
    """With the request phase only, Envoy closes the stream right after the picker answers: the
    request must keep counting in since_scrape (the metrics do not show it yet), or a burst
    between two scrapes would pile onto one endpoint."""
    r = make_router(n=1)
    d = r.decide(req(body(prompt="y" * 400)))
    state = r.endpoints["10.0.0.1:8000"]
    r.on_request_done(d.request_id)
    assert state.inflight == 0 and state.since_scrape == 1 and state.since_scrape_tokens == 100
    r.on_scrape_ok("10.0.0.1:8000", metrics_text(running=1))
    assert state.since_scrape == 0 and state.since_scrape_tokens == 0

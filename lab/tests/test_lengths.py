"""Learned output lengths in the lab: hidden lengths, outcomes reaching the picker, the
distribution oracle, the predictor's accuracy in a run's summary."""

import math

import pytest

from lab.distribution_oracle import DistributionOracle
from lab.picker_policy import OUTCOME_FLUSH, PickerPolicy, forecast_accuracy
from lab.policies import make_policy
from lab.simulation import LabConfig, prepare_requests, run_lab
from local.sim.engines import A10_QWQ32B
from loadtest.workloads import build_workload
from picker.lengths.predictor import Forecast, LEVELS


@pytest.fixture(scope="module")
def client_mix():
    return prepare_requests(build_workload("client-mix", seed=7, num_prompts=90), 16)


def test_the_body_hides_the_length_behind_the_cap(client_mix):
    for r in client_mix[:20]:
        body = r.body("qwq")
        assert body["max_tokens"] == 9000 and "ignore_eos" not in body
        assert r.headers()["x-client-id"] in ("chat-app", "agent-app", "reasoner-app")
        assert r.length_dist is not None and r.max_tokens <= 9000


def test_outcomes_reach_the_picker_at_the_access_logs_next_flush(client_mix):
    policy = PickerPolicy("lengths")
    run = run_lab(client_mix, policy, LabConfig(concurrency=12, seed=1))
    assert run.summary["completed"] == len(client_mix)
    router = policy.router
    pending = [outcome for _, _, outcome in policy.outcomes]   # not yet flushed at the run's end
    # every answer was learned, or is still in the access log's buffer
    assert router.predictor.learned + len(pending) == len(client_mix)
    assert all(o.finished_at == math.floor(o.finished_at / OUTCOME_FLUSH) * OUTCOME_FLUSH
               for o in pending)
    # what is still tracked in flight is exactly what has not been reported
    assert set(router.work.by_id) <= {o.request_id for o in pending}


def test_the_picker_learns_each_applications_lengths_from_its_client_id(client_mix):
    policy = PickerPolicy("lengths")
    run_lab(client_mix, policy, LabConfig(concurrency=12, seed=1))
    late = policy.forecasts[45:]
    by_class = {}
    for request, forecast in late:
        by_class.setdefault(request.length_class, []).append(forecast.median)
    medians = {c: sorted(v)[len(v) // 2] for c, v in by_class.items()}
    assert medians["chat"] < 400 < medians["agent"] < 1500 < medians["reasoner"]
    summary_keys = policy.report()
    assert 0 < summary_keys["length_rel_error_median_learned"] < summary_keys["length_rel_error_median"] + 0.2
    assert 0.5 < summary_keys["length_p90_coverage_learned"] <= 1.0


def test_forecast_accuracy_measures_error_and_coverage():
    f = Forecast(tuple(100.0 + i for i in range(len(LEVELS))), "prior", 1.0)
    pairs = [(f, 100), (f, 110), (f, 300), (f, 50)] * 20
    acc = forecast_accuracy(pairs)
    median = f.median
    assert acc["length_abs_error_median"] == pytest.approx(sorted(
        abs(median - n) for _, n in pairs)[len(pairs) // 2])
    assert acc["length_p90_coverage"] == pytest.approx(0.75)   # 300 is above the 0.9 quantile
    assert "length_p90_coverage_learned" in acc
    assert forecast_accuracy([]) == {}


def test_the_distribution_oracle_knows_classes_not_lengths(client_mix):
    # Same requests, lengths redrawn within each class: the clairvoyant oracle changes its
    # choices, the distribution oracle cannot tell the difference.
    import copy
    import random
    twin = copy.deepcopy(client_mix)
    rng = random.Random(3)
    for r in twin:
        r.max_tokens = max(1, int(r.max_tokens * rng.uniform(0.5, 1.5)))
    cfg = LabConfig(concurrency=12, seed=2, engine_models=[A10_QWQ32B.with_overrides(num_gpu_blocks=900)] * 3)
    routes = {}
    for name, reqs in (("a", client_mix), ("b", twin)):
        for policy in ("oracle", "oracle-dist"):
            p = make_policy(policy)
            chosen = []
            original = p.pick

            def pick(request, original=original, chosen=chosen):
                ep = original(request)
                chosen.append(ep.index)
                return ep
            p.pick = pick
            run_lab(reqs, p, cfg)
            routes[(name, policy)] = chosen
    n = 12   # the first decisions, before the redrawn lengths change the engines' states
    assert routes[("a", "oracle-dist")][:n] == routes[("b", "oracle-dist")][:n]
    assert routes[("a", "oracle")] != routes[("b", "oracle")]


def test_the_distribution_oracle_falls_back_to_the_answers_seen(client_mix):
    reqs = prepare_requests(build_workload("demo", seed=1, num_prompts=20), 16)
    for r in reqs:
        r.length_dist = None
    run = run_lab(reqs, DistributionOracle(), LabConfig(concurrency=6, seed=0))
    assert run.summary["completed"] == 20

"""Routing lab: determinism, result format, policy behaviour, the picker adapter."""

import json
import random

import pytest

from lab.__main__ import main as lab_main
from lab.policies import LeastRequest, make_policy
from lab.policy_api import LabEndpoint
from lab.simulation import LabConfig, prepare_requests, run_lab
from local.sim.engine import Engine
from local.sim.engines import A10_QWQ32B
from loadtest.workloads import build_workload

N = 30


@pytest.fixture(scope="module")
def requests():
    return prepare_requests(build_workload("demo", seed=3, num_prompts=N), 16)


def config(**kw):
    return LabConfig(concurrency=kw.pop("concurrency", 15), seed=kw.pop("seed", 1), **kw)


def test_same_seed_same_result(requests):
    a = run_lab(requests, make_policy("random"), config()).summary
    b = run_lab(requests, make_policy("random"), config()).summary
    c = run_lab(requests, make_policy("random"), config(seed=2)).summary
    assert a == b
    assert a["per_endpoint"] != c["per_endpoint"]


def test_result_has_vllm_fields_and_consistent_totals(requests):
    run = run_lab(requests, make_policy("least-request"), config())
    s = run.summary
    assert s["completed"] == N and s["failed"] == 0
    assert s["total_output_tokens"] == sum(r.max_tokens for r in requests)
    assert s["total_input_tokens"] == sum(len(r.token_ids) for r in requests)
    assert s["output_throughput"] == pytest.approx(s["total_output_tokens"] / s["duration"])
    for m in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p99"):
            assert f"{stat}_{m}_ms" in s
    # Unloaded lower bound: a prefill of >= 800 new tokens takes >= 2 stages x base time.
    assert s["median_ttft_ms"] > 2 * A10_QWQ32B.stage_base_s * 1000
    series = run.series["127.0.0.1:8101"]
    assert len(series["t"]) > 5 and max(series["kv"]) > 0
    assert len(series["t"]) == len(series["kv"]) == len(series["running"])


def test_round_robin_spreads_exactly(requests):
    run = run_lab(requests, make_policy("round-robin"), config())
    assert [v["requests"] for v in run.per_endpoint.values()] == [10, 10, 10]


def test_concurrency_limit_is_respected(requests):
    one = run_lab(requests, make_policy("round-robin"), config(concurrency=1))
    many = run_lab(requests, make_policy("round-robin"), config(concurrency=30))
    starts_ends = sorted((s.start, s.end) for s in one.samples)
    assert all(e1 <= s2 for (_, e1), (s2, _) in zip(starts_ends, starts_ends[1:]))
    assert many.summary["duration"] < one.summary["duration"]


def test_least_request_prefers_the_less_loaded_and_keeps_first_on_ties():
    eps = [LabEndpoint(i, f"e{i}", Engine(A10_QWQ32B)) for i in range(3)]
    eps[0].inflight = 5
    policy = LeastRequest()
    policy.start(eps, lambda: 0.0, random.Random(7))
    picks = [policy.pick(None).index for _ in range(900)]
    # endpoint 0 wins only when both draws hit it: 1/9 of the time.
    assert 60 < picks.count(0) < 140
    eps[0].inflight = 0
    rng_copy = random.Random(11)
    policy.start(eps, lambda: 0.0, random.Random(11))
    assert policy.pick(None).index == rng_copy.randrange(3)


def test_picker_policy_uses_router_with_scrapes(requests):
    policy = make_policy("picker")
    run = run_lab(requests, policy, config())
    assert run.summary["completed"] == N
    assert policy.scrapes >= 3 and not policy.router.inflight   # every request reported done
    assert sum(1 for v in run.per_endpoint.values() if v["requests"]) == 3


def test_unknown_policy_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fastest")


def test_cli_run_writes_results(tmp_path, capsys):
    rc = lab_main(["run", "--workload", "smoke", "--policy", "round-robin", "--policy",
                   "least-request", "--seeds", "0", "1", "--out", str(tmp_path), "--plots"])
    assert rc == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["policies"]) == {"round-robin", "least-request"}
    assert summary["settings"]["workload"]["num_prompts"] == 12
    lr, rr = (summary["policies"][p]["mean_ttft_ms"] for p in ("least-request", "round-robin"))
    assert len(rr["values"]) == 2 and rr["mean"] == pytest.approx(sum(rr["values"]) / 2)
    change = summary["versus_baseline"]["round-robin"]["mean_ttft_ms"]["change_pct"]
    assert change == pytest.approx((rr["mean"] - lr["mean"]) / lr["mean"] * 100)
    assert "least-request" not in summary["versus_baseline"]
    one = json.loads((tmp_path / "smoke-least-request-seed1.json").read_text())
    assert one["completed"] == 12 and one["policy"] == "least-request"
    assert (tmp_path / "smoke-round-robin-seed0.series.json").exists()
    assert "round-robin" in capsys.readouterr().out
    assert len(one["ttfts"]) == 12
    assert (tmp_path / "ttft_cdf.png").stat().st_size > 1000
    assert (tmp_path / "kv_least-request_seed0.png").exists()


def test_request_rate_spreads_arrivals(requests):
    run = run_lab(requests, make_policy("round-robin"),
                  config(concurrency=None, request_rate=0.5))
    starts = sorted(s.start for s in run.samples)
    assert starts[0] > 0 and starts[-1] > 20        # 30 arrivals at 0.5/s: about 60 s apart
    assert run.summary["completed"] == N


def test_smoke_picker_beats_least_request_on_the_article_workload():
    """Smoke version of the lab benchmark (`python -m bench lab`): 1 seed, 120 of the article's 300 prompts."""
    reqs = prepare_requests(build_workload("article", seed=0, num_prompts=120), 16)
    least = run_lab(reqs, make_policy("least-request"), LabConfig(seed=0)).summary
    picker = run_lab(reqs, make_policy("picker"), LabConfig(seed=0)).summary
    assert least["completed"] == picker["completed"] == 120
    assert picker["mean_ttft_ms"] < least["mean_ttft_ms"]


def test_smoke_picker_keeps_tenant_affinity_on_the_shared_prefix_workload():
    """Smoke version of the shared-prefix benchmark: 1 seed, 150 of its 400 prompts. Spreading
    12 tenants' 4,000-token system prompts over every group thrashes each group's prefix cache;
    the picker keeps tenants together, hits the cache far more and answers much sooner."""
    reqs = prepare_requests(build_workload("shared-prefix", seed=0, num_prompts=150), 16)
    least = run_lab(reqs, make_policy("least-request"), LabConfig(seed=0))
    picker = run_lab(reqs, make_policy("picker"), LabConfig(seed=0))

    def hit_rate(run):
        eps = run.per_endpoint.values()
        return sum(e["prefix_cache_hits"] for e in eps) / sum(e["prefix_cache_queries"] for e in eps)
    assert least.summary["completed"] == picker.summary["completed"] == 150
    assert hit_rate(picker) > hit_rate(least) + 0.2
    assert picker.summary["mean_ttft_ms"] < least.summary["mean_ttft_ms"] / 2


def test_cli_runs_a_profile_file_and_names_its_results_safely(tmp_path):
    profile = tmp_path / "profiles" / "mine.yaml"
    profile.parent.mkdir()
    profile.write_text("name: mine\nscorers: [{type: queue, weight: 1}]\npicker: {type: max-score}\n")
    out = tmp_path / "out"
    rc = lab_main(["run", "--workload", "smoke", "--policy", f"picker:{profile}", "--out",
                   str(out), "--plots"])
    assert rc == 0
    results = [p.name for p in out.glob("smoke-picker_*-seed0.json")]
    assert len(results) == 1 and "/" not in results[0] and results[0].endswith("mine.yaml-seed0.json")
    assert json.loads((out / results[0]).read_text())["completed"] == 12
    assert len(list(out.glob("kv_picker_*mine.yaml_seed0.png"))) == 1


def test_an_idle_engine_steps_on_the_first_request_and_later_ones_join_the_next_step(requests):
    # Two prompts sent at the same instant to one engine: like vLLM (and local.sim.server), the
    # engine starts stepping when the first arrives; the second waits for the next step.
    two = requests[:2]
    run = run_lab(two, make_policy("round-robin"), config(num_engines=1, concurrency=None))
    first, second = sorted(run.samples, key=lambda s: s.ttft)
    alone = A10_QWQ32B.pipeline_stages * (
        A10_QWQ32B.stage_base_s + A10_QWQ32B.stage_prefill_token_s * first.prompt_tokens
        + A10_QWQ32B.stage_context_token_s * first.prompt_tokens)
    assert first.ttft == pytest.approx(alone)
    assert second.ttft > first.ttft + A10_QWQ32B.pipeline_stages * A10_QWQ32B.stage_base_s

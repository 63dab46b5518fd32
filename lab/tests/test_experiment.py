"""The experiment runner and the statistics over seeds."""

import math

import pytest

from lab.experiment import named_workload, run_policies, summaries
from lab.policies import make_policy
from lab.simulation import LabConfig, prepare_requests, run_lab
from lab.stats import aggregate, over_seeds, versus
from loadtest.workloads import build_workload


def test_each_run_equals_a_direct_run_with_the_seed_in_the_config():
    config = LabConfig(concurrency=4, num_engines=2)
    runs = run_policies(named_workload("smoke"), ["random", "least-request"], [3, 5], config)
    assert list(runs) == ["random", "least-request"]
    for name, per_seed in runs.items():
        for seed, run in zip([3, 5], per_seed):
            requests = prepare_requests(build_workload("smoke", seed=seed), config.block_size)
            direct = run_lab(requests, make_policy(name), LabConfig(concurrency=4, num_engines=2,
                                                                   seed=seed))
            assert run.summary == direct.summary
            assert run.summary["seed"] == seed
            assert run.wall_s > 0 and run.cpu_s >= 0


def test_workload_seed_keeps_the_prompts_and_policy_factories_are_called_per_run():
    built, made = [], []

    def workload(seed):
        built.append(seed)
        return build_workload("smoke", seed=seed)

    def factory():
        made.append(1)
        return make_policy("random")

    seen = []
    runs = run_policies(workload, {"mine": factory}, [0, 1, 2], LabConfig(concurrency=4),
                        workload_seed=7, on_run=lambda name, seed, run: seen.append((name, seed)))
    assert built == [7]                      # built and tokenised once for all seeds
    assert len(made) == 3                    # a fresh policy per run
    assert seen == [("mine", 0), ("mine", 1), ("mine", 2)]
    prompts = {r.summary["total_input_tokens"] for r in runs["mine"]}
    assert len(prompts) == 1                 # the same prompts every seed
    assert len({str(r.summary["per_endpoint"]) for r in runs["mine"]}) > 1   # seeds differ


def test_over_seeds_is_population_statistics():
    s = over_seeds([1.0, 2.0, 3.0, 6.0])
    assert s == {"mean": 3.0, "std": pytest.approx(math.sqrt(3.5)), "min": 1.0, "max": 6.0,
                 "values": [1.0, 2.0, 3.0, 6.0]}


def test_aggregate_and_versus_from_runs():
    runs = run_policies(named_workload("smoke"), ["least-request", "round-robin"], [0, 1],
                        LabConfig(concurrency=4))
    agg = aggregate(summaries(runs), ["mean_ttft_ms", "output_throughput", "p99_ttft_ms"])
    lr = [r.summary["mean_ttft_ms"] for r in runs["least-request"]]
    assert agg["least-request"]["mean_ttft_ms"]["values"] == lr
    change = versus(agg, "least-request")["round-robin"]["mean_ttft_ms"]
    rr = agg["round-robin"]["mean_ttft_ms"]["mean"]
    assert change["change_pct"] == pytest.approx((rr - sum(lr) / 2) / (sum(lr) / 2) * 100)
    assert versus(agg, "oracle") == {}

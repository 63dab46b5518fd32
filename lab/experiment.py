"""The experiment runner: policies x seeds on one workload, the loop every lab and bench
experiment uses (`python -m lab run`, the scenario matrix, picker replicas, the benchmarks).

    runs = run_policies(named_workload("article"), ["least-request", "picker"], seeds=[0, 1],
                        config=LabConfig(concurrency=30))
    runs["picker"][1].summary            # policy -> one LabRun per seed, in the seeds' order

For each seed the workload's prompts are built and tokenised once and every policy runs on those
same requests, with `config` and `seed` = the seed (the policy's randomness and the arrival
times). With `workload_seed` the prompts stay those of that seed for all seeds (only the
policies' randomness changes). `config` is the only description of the pool and the client: a
field added to LabConfig reaches every experiment through it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Mapping, Optional, Sequence, Union

from lab.policies import make_policy
from lab.policy_api import Policy
from lab.simulation import LabConfig, LabRun, prepare_requests, run_lab
from loadtest.workloads import build_workload

Workload = Callable[[int], Sequence]            # seed -> loadtest.workloads.PromptSpec list
Policies = Union[Sequence[str], Mapping[str, Callable[[], Policy]]]   # names, or name -> factory
OnRun = Callable[[str, int, LabRun], None]


def named_workload(name: str, num_prompts: Optional[int] = None, **options) -> Workload:
    """A workload of loadtest/workloads.py by name (options: e.g. `path` of a trace)."""
    return lambda seed: build_workload(name, seed=seed, num_prompts=num_prompts, **options)


def run_policies(workload: Workload, policies: Policies, seeds: Sequence[int],
                 config: Optional[LabConfig] = None, *, workload_seed: Optional[int] = None,
                 on_run: Optional[OnRun] = None) -> dict[str, list[LabRun]]:
    """Every policy on every seed: policy name -> LabRun per seed (`wall_s`, `cpu_s` set).
    `policies`: names for lab.policies.make_policy, or name -> a function making the policy.
    `on_run(name, seed, run)` is called after each run (progress lines, files)."""
    config = config or LabConfig()
    makers = (dict(policies) if isinstance(policies, Mapping)
              else {name: (lambda name=name: make_policy(name)) for name in policies})
    results: dict[str, list[LabRun]] = {name: [] for name in makers}
    prepared: tuple = (None, None)
    for seed in seeds:
        prompts_seed = seed if workload_seed is None else workload_seed
        if prepared[0] != prompts_seed:
            prepared = (prompts_seed, prepare_requests(workload(prompts_seed), config.block_size))
        for name, make in makers.items():
            run = timed_run(prepared[1], make(), dataclasses.replace(config, seed=seed))
            results[name].append(run)
            if on_run is not None:
                on_run(name, seed, run)
    return results


def timed_run(requests: Sequence, policy: Policy, config: LabConfig) -> LabRun:
    """run_lab with the run's wall and CPU seconds recorded on the LabRun."""
    wall, cpu = time.perf_counter(), time.process_time()
    run = run_lab(requests, policy, config)
    run.wall_s, run.cpu_s = time.perf_counter() - wall, time.process_time() - cpu
    return run


def summaries(results: Mapping[str, Sequence[LabRun]]) -> dict[str, list[dict]]:
    """policy -> the runs' summaries (the input of lab.stats.aggregate)."""
    return {name: [r.summary for r in runs] for name, runs in results.items()}

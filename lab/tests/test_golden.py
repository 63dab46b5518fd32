"""Pinned results of small lab runs: any change to what a run computes fails here.

Every case runs a few policies on a small workload and compares the whole summary (every float
exactly) and a digest of every request's sample (send time, TTFT, each inter-token gap, end,
endpoint) with `golden_runs.json`. Speed-ups of the lab, the engine model or the policies must
leave them bit-identical. A change that is meant to change results (a routing change, a bug fix
in the engine model) rewrites the file and says so in its commit:

    PYTHONPATH=.:picker/src .venv/bin/python -m lab.tests.test_golden --update

The cases cover what the matrix exercises: the closed loop, preemptions in a KV-starved pool,
shared prefixes with eviction (and precise prefix routing on KV-cache events), bursty open-loop
arrivals (flow control and the late-binding oracle hold requests), a heterogeneous pool with an
outage, and `max_tokens` sent as a cap.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
from pathlib import Path

import pytest

from lab.policies import make_policy
from lab.simulation import LabConfig, prepare_requests, run_lab
from local.sim.engines import A10_QWQ32B
from loadtest.workloads import build_workload

GOLDEN = Path(__file__).with_name("golden_runs.json")

_SLOW_SMALL = A10_QWQ32B.with_overrides(
    num_gpu_blocks=500, stage_base_s=A10_QWQ32B.stage_base_s * 1.5,
    stage_decode_seq_s=A10_QWQ32B.stage_decode_seq_s * 1.5)
_STARVED = A10_QWQ32B.with_overrides(num_gpu_blocks=160)
_SMALL = A10_QWQ32B.with_overrides(num_gpu_blocks=300)

# name -> (workload, options, prompts seed, LabConfig fields, policies)
CASES = {
    "closed": ("demo", dict(num_prompts=60), 0, dict(num_engines=3, concurrency=30),
               ["least-request", "round-robin", "picker", "picker-upstream", "picker-flow",
                "oracle", "oracle-late", "picker+precise", "picker:lengths", "oracle-dist"]),
    "kv-starved": ("demo", dict(num_prompts=36), 1,
                   dict(num_engines=3, concurrency=12, engine_models=[_STARVED] * 3),
                   ["least-request", "picker", "picker-flow", "oracle", "oracle-late",
                    "picker:lengths", "oracle-dist"]),
    "shared-prefix": ("shared-prefix", dict(num_prompts=40, num_groups=12, system_prompt_len=1000,
                                            question_len=200, output_len=100), 2,
                      dict(num_engines=2, concurrency=10, engine_models=[_SMALL] * 2),
                      ["least-request", "picker", "picker+precise", "oracle"]),
    "open-bursty": ("demo", dict(num_prompts=40), 3,
                    dict(num_engines=3, concurrency=None, request_rate=0.5, burstiness=0.25),
                    ["least-request", "picker", "picker-flow", "oracle", "oracle-late"]),
    "outage": ("demo", dict(num_prompts=40), 4,
               dict(num_engines=3, concurrency=12, outages=((1, 20.0, 60.0),),
                    engine_models=[_SLOW_SMALL, A10_QWQ32B, A10_QWQ32B]),
               ["least-request", "picker", "picker-flow", "oracle", "oracle-late"]),
    "capped": ("chat-reasoning", dict(num_prompts=30), 5,
               dict(num_engines=3, concurrency=10, max_tokens_cap=4096),
               ["picker", "picker-flow", "oracle", "picker:lengths", "oracle-dist"]),
}


def _sample_digest(samples) -> str:
    h = hashlib.sha256()
    for s in samples:
        h.update(repr((s.start, s.success, s.ttft, s.latency, s.end, s.itl, s.output_tokens,
                       s.prompt_tokens, s.target, s.error, s.group)).encode())
    return h.hexdigest()


def _clean(value):
    """JSON-safe: NaN and infinities as strings (json would write invalid tokens)."""
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def run_case(name: str) -> dict:
    """policy -> {"summary": the run's summary, "samples": digest of its samples}."""
    workload, options, seed, fields, policies = CASES[name]
    config = LabConfig(**fields)
    requests = prepare_requests(build_workload(workload, seed=seed, **options), config.block_size)
    out = {}
    for policy in policies:
        run = run_lab(requests, make_policy(policy), dataclasses.replace(config, seed=seed))
        out[policy] = {"summary": _clean(run.summary), "samples": _sample_digest(run.samples)}
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_runs_are_bit_identical_to_the_pinned_ones(case):
    expected = json.loads(GOLDEN.read_text())[case]
    got = json.loads(json.dumps(run_case(case)))     # the same JSON round trip as the file
    assert sorted(got) == sorted(expected)
    for policy in expected:
        want, have = expected[policy]["summary"], got[policy]["summary"]
        diff = {k: (want.get(k), have.get(k)) for k in set(want) | set(have)
                if want.get(k) != have.get(k)}
        assert not diff, f"{case} / {policy}: summary changed (pinned, now): {diff}"
        assert have["completed"] > 0
        assert got[policy]["samples"] == expected[policy]["samples"], \
            f"{case} / {policy}: some request's times changed (summary equal)"


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        raise SystemExit("usage: python -m lab.tests.test_golden --update")
    GOLDEN.write_text(json.dumps({case: run_case(case) for case in sorted(CASES)}, indent=1,
                                 sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")

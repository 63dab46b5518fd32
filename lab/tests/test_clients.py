"""Several closed-loop clients in the lab (LabConfig.group_concurrency): each group of requests
has its own concurrency limit, waits only for its own slots, and its held requests count in them."""
from __future__ import annotations

import pytest

from lab.policies import make_policy
from lab.simulation import LabConfig, prepare_requests, run_lab
from local.sim.engines import A10_QWQ32B
from loadtest.workloads import build_workload

LIMITS = {"chat": 2, "reasoning": 4}


@pytest.fixture(scope="module")
def requests():
    """36 requests, 2 groups: chat answers 50-400 tokens, reasoning 1,500-4,000."""
    reqs = prepare_requests(build_workload("chat-reasoning", seed=5, num_prompts=36), A10_QWQ32B.block_size)
    assert {r.group for r in reqs} == set(LIMITS)
    return reqs


def max_in_flight(samples, group=None) -> int:
    """The most requests of `group` (None: all) between their send and their end at once."""
    edges = sorted((t, d) for s in samples if group in (None, s.group) for t, d in ((s.start, 1), (s.end, -1)))
    n = best = 0
    for _, d in edges:   # at equal times an end (-1) sorts first: a slot freed and taken at once
        n += d
        best = max(best, n)
    return best


@pytest.mark.parametrize("policy", ["least-request", "picker-flow"])
def test_each_group_stays_within_its_own_concurrency(requests, policy):
    run = run_lab(requests, make_policy(policy), LabConfig(concurrency=None, group_concurrency=LIMITS, seed=1))
    assert run.summary["completed"] == len(requests) and run.summary["group_concurrency"] == LIMITS
    for group, limit in LIMITS.items():
        assert max_in_flight(run.samples, group) == limit
    assert max_in_flight(run.samples) == sum(LIMITS.values())


def test_a_group_waits_only_for_its_own_slots(requests):
    """Every chat request after the first two is sent the instant a chat request ends, however
    long the reasoning requests run (a shared loop of 6 would send it when any request ends)."""
    run = run_lab(requests, make_policy("least-request"), LabConfig(concurrency=None, group_concurrency=LIMITS, seed=1))
    chat = sorted((s for s in run.samples if s.group == "chat"), key=lambda s: s.start)
    ends = sorted(s.end for s in chat)
    assert [s.start for s in chat[:2]] == [0.0, 0.0]
    for i, s in enumerate(chat[2:]):
        assert s.start == ends[i]   # the (i+1)-th chat end frees the slot of request i+2
    shared = run_lab(requests, make_policy("least-request"), LabConfig(concurrency=6, seed=1))
    assert max_in_flight(shared.samples, "chat") > LIMITS["chat"]


def test_the_total_cap_still_applies(requests):
    run = run_lab(requests, make_policy("least-request"),
                  LabConfig(concurrency=3, group_concurrency=LIMITS, seed=1))
    assert max_in_flight(run.samples) == 3 and run.summary["completed"] == len(requests)


def test_a_group_without_a_limit_is_a_clear_error(requests):
    with pytest.raises(ValueError, match="no limit for group.*'reasoning'"):
        run_lab(requests, make_policy("least-request"), LabConfig(group_concurrency={"chat": 2}))
    with pytest.raises(ValueError, match=">= 1"):
        run_lab(requests, make_policy("least-request"), LabConfig(group_concurrency={"chat": 0, "reasoning": 1}))

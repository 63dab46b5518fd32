"""Late binding in the lab: the picker's own flow control (picker-flow) and the late oracle hold
requests; the hold counts in TTFT; a max_tokens cap different from the true lengths changes
nothing for a policy that does not read max_tokens."""
from __future__ import annotations

import pytest

from lab.policies import make_policy
from lab.simulation import LabConfig, prepare_requests, run_lab
from local.sim.engines import A10_QWQ32B
from loadtest.workloads import build_workload


@pytest.fixture(scope="module")
def requests():
    return prepare_requests(build_workload("article", seed=3, num_prompts=40), A10_QWQ32B.block_size)


def run(requests, policy, **kw):
    return run_lab(requests, make_policy(policy), LabConfig(seed=3, concurrency=30, **kw))


@pytest.mark.parametrize("policy", ["picker-flow", "oracle-late"])
def test_late_binding_holds_and_every_request_completes(requests, policy):
    lab = run(requests, policy)
    s = lab.summary
    assert s["completed"] + s["failed"] == len(requests) and s["completed"] >= len(requests) - 2
    # 30 requests at t=0 on 3 groups with KV for far fewer: some were held before their send to
    # an engine, and their TTFT counts from the client's send (the hold included)
    first_token = sorted(x.ttft for x in lab.samples if x.success)
    assert first_token[-1] > 10.0


def test_a_max_tokens_cap_does_not_change_the_picker(requests):
    """The picker reads max_tokens only as a cap it does not use: the same run with clients
    sending max_tokens 16384 (no ignore_eos) gives the same placements and TTFTs."""
    exact = run(requests, "picker-flow")
    capped = run(requests, "picker-flow", max_tokens_cap=16384)
    assert [(x.target, x.ttft) for x in exact.samples] == [(x.target, x.ttft) for x in capped.samples]
    body = requests[0].body("qwq")  # as the capped run's clients sent it
    assert body["max_tokens"] == 16384 != requests[0].max_tokens and "ignore_eos" not in body

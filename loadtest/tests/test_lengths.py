"""Answer-length distributions and the class mixes that hide lengths behind observable fields."""

import numpy as np
import pytest

from loadtest import lengths
from loadtest.openai_api import request_body
from loadtest.prompts import PromptSpec
from loadtest.workloads import build_workload


@pytest.mark.parametrize("dist", [("const", 300), ("uniform", 50, 400),
                                  ("lognormal", 700, 1.0, 8, 10000), ("logt", 2500, 0.6, 3, 64, 10000)])
def test_samples_follow_their_quantiles(dist):
    rng = np.random.default_rng(0)
    draws = lengths.sample(dist, rng, 20000)
    q = lengths.quantiles(dist)
    assert len(q) == lengths.GRID and list(q) == sorted(q)
    assert draws.min() >= (dist[-2] if dist[0] != "const" else dist[1])
    assert abs(np.median(draws) - lengths.median(dist)) <= 0.05 * lengths.median(dist) + 1


def test_log_t_has_the_heavier_tail():
    normal = lengths.quantiles(("lognormal", 1000, 0.6, 1, 10**6))
    heavy = lengths.quantiles(("logt", 1000, 0.6, 3, 1, 10**6))
    assert heavy[-1] > 1.3 * normal[-1]


def test_residual_given_what_was_produced():
    dist = ("uniform", 100, 200)
    assert lengths.residual(dist, 0) == pytest.approx(150 - 0, rel=0.02)
    assert lengths.residual(dist, 150) == pytest.approx(25, rel=0.1)
    assert lengths.residual(dist, 500) == 1.0


@pytest.mark.parametrize("bad", [("zipf", 1), ("uniform", 5), ("uniform", 10, 5), ("lognormal", 0, 1, 1, 9),
                                 ("logt", 10, 1, 0, 1, 9), ("const", 0)])
def test_bad_distributions_are_refused(bad):
    with pytest.raises(ValueError):
        lengths.check(bad)


def test_client_mix_shows_the_class_only_in_the_client_id():
    specs = build_workload("client-mix", seed=1, num_prompts=600)
    by_client = {}
    for s in specs:
        by_client.setdefault(s.client, []).append(s)
        assert s.cap == 9000 and s.extra is None and s.length_dist is not None
    medians = {c: np.median([s.output_tokens for s in v]) for c, v in by_client.items()}
    assert medians["chat-app"] < 300 < medians["agent-app"] < 1500 < medians["reasoner-app"]
    prompts = {c: np.median([s.prompt_tokens for s in v]) for c, v in by_client.items()}
    assert max(prompts.values()) < 1.3 * min(prompts.values())      # prompts tell nothing


def test_template_mix_opens_each_class_with_its_own_system_prompt():
    specs = build_workload("template-mix", seed=2, num_prompts=200)
    openings = {}
    for s in specs:
        openings.setdefault(s.length_class, set()).add(" ".join(s.prompt.split(" ")[:600]))
    assert len(openings) == 8 and all(len(v) == 1 for v in openings.values())
    assert len({next(iter(v)) for v in openings.values()}) == 8
    assert {s.client for s in specs} == {"app"}


def test_reasoning_mix_carries_the_thinking_switch():
    specs = build_workload("reasoning-mix", seed=3, num_prompts=300)
    for s in specs:
        thinking = s.extra["chat_template_kwargs"]["enable_thinking"]
        assert thinking == (s.length_class == "reasoning")


def test_a_capped_request_sends_the_cap_and_min_tokens_for_the_simulator():
    spec = PromptSpec(prompt="a b", prompt_tokens=2, output_tokens=37, cap=4096,
                      extra={"reasoning_effort": "high"})
    body = request_body(spec, "completions", "qwq")
    assert body["max_tokens"] == 4096 and body["min_tokens"] == 37 and body["ignore_eos"] is False
    assert body["reasoning_effort"] == "high"
    chat = request_body(spec, "chat", "qwq")
    assert chat["max_completion_tokens"] == 4096
    legacy = request_body(PromptSpec("a b", 2, 37), "completions", "qwq")
    assert legacy["max_tokens"] == 37 and legacy["ignore_eos"] is True and "min_tokens" not in legacy

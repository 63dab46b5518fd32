import json

import numpy as np
import pytest

from loadtest.workloads import WORKLOADS, build_workload, workload_settings


def test_legacy_random_lengths_prefix_and_determinism():
    w = build_workload("article", seed=3, num_prompts=400)
    prefix = " ".join(w[0].prompt.split()[:1000])
    inputs = np.array([p.prompt_tokens - 1000 for p in w])
    outputs = np.array([p.output_tokens for p in w])
    assert all(p.prompt.startswith(prefix + " ") for p in w)
    assert inputs.min() >= 800 and inputs.max() <= 4000       # [int(0.2*4000), 4000]
    assert outputs.min() >= 600 and outputs.max() <= 3000
    # legacy semantics: mean ~ 1000 + 2400 input (the article's 3,380), ~1800 output
    assert abs(inputs.mean() - 2400) < 150 and abs(outputs.mean() - 1800) < 100
    assert all(len(p.prompt.split(" ")) == p.prompt_tokens for p in w[:20])
    assert build_workload("article", seed=3, num_prompts=400) == w
    assert build_workload("article", seed=4, num_prompts=400) != w


def test_ratio_one_gives_fixed_lengths_and_zero_output_is_clamped():
    w = build_workload("smoke", input_len=30, output_len=7, range_ratio=1.0, prefix_len=0)
    assert {p.prompt_tokens for p in w} == {30} and {p.output_tokens for p in w} == {7}
    w0 = build_workload("smoke", output_len=1, range_ratio=0.0, num_prompts=50)
    assert min(p.output_tokens for p in w0) == 1


def test_shared_prefix_groups_share_system_prompt():
    w = build_workload("shared-prefix", num_groups=3, system_prompt_len=50, question_len=5,
                       num_prompts=60)
    by_group = {}
    for p in w:
        by_group.setdefault(p.group, set()).add(p.messages[0]["content"])
        assert p.prompt == p.messages[0]["content"] + " " + p.messages[1]["content"]
        assert p.prompt_tokens == 55
    assert len(by_group) == 3 and all(len(v) == 1 for v in by_group.values())
    assert len({next(iter(v)) for v in by_group.values()}) == 3


def test_sharegpt_file_sampling_and_pruning(tmp_path):
    convs = [{"conversations": [{"from": "human", "value": f"question  number {i} here please"},
                                {"from": "gpt", "value": " ".join(["ans"] * (5 + i))}]}
             for i in range(10)]
    convs.append({"conversations": [{"from": "human", "value": "too short"},
                                    {"from": "gpt", "value": "a b c d e"}]})
    convs.append({"conversations": [{"from": "human", "value": "single turn only"}]})
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(convs))
    w = build_workload("sharegpt", path=str(path), num_prompts=100, seed=1)
    assert len(w) == 10
    assert {p.output_tokens for p in w} == set(range(5, 15))
    assert all(p.prompt_tokens == 5 and "  " not in p.prompt for p in w)
    assert [p.prompt for p in build_workload("sharegpt", path=str(path), seed=2)] != \
        [p.prompt for p in w]
    assert {p.output_tokens for p in build_workload("sharegpt", path=str(path),
                                                    output_len=9)} == {9}


def test_bad_input_has_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown workload"):
        build_workload("nope")
    with pytest.raises(ValueError, match="no parameter 'path'"):
        build_workload("demo", path="x")
    with pytest.raises(ValueError, match="needs path"):
        build_workload("sharegpt")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="cannot read"):
        build_workload("sharegpt", path=str(tmp_path / "bad.json"))


def test_workloads_are_complete():
    assert workload_settings("article") == dict(WORKLOADS["article"])
    for name, p in WORKLOADS.items():
        assert "kind" in p and "num_prompts" in p, name

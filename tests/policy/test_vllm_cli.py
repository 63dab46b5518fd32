"""validation/vllm_cli.py: the flags of every `vllm serve` against the pinned vLLM's own CLI."""

from __future__ import annotations

import copy

import pytest
import yaml

from validation.vllm_cli import FLAGS_DIR, IMAGE, known_flags, vllm_flags_exist

LWS = yaml.safe_load("""
apiVersion: leaderworkerset.x-k8s.io/v1
kind: LeaderWorkerSet
metadata: {name: g, namespace: llm}
spec:
  leaderWorkerTemplate:
    size: 2
    leaderTemplate:
      metadata: {labels: {role: leader}}
      spec:
        containers:
          - name: vllm-leader
            image: vllm/vllm-openai:v0.32.0
            command: ["/bin/bash", "/opt/multinode/leader.sh"]
            args: [vllm, serve, /mnt/models, --port, "8000", --served-model-name, qwq,
                   --max-model-len=16384, --kv-events-config, '{"enable_kv_cache_events":true}']
    workerTemplate:
      spec:
        containers: [{name: vllm-worker, image: "vllm/vllm-openai:v0.32.0"}]
""")


def with_leader(image=None, extra=()):
    obj = copy.deepcopy(LWS)
    c = obj["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]
    if image:
        c["image"] = image
    c["args"] += list(extra)
    return [obj]


def test_the_pinned_versions_list_is_the_real_cli():
    flags = known_flags("v0.32.0")
    assert flags and len(flags) > 300 and "--kv-events-config" in flags
    assert "--disable-log-requests" not in flags            # removed before 0.32


def test_known_flags_pass():
    assert vllm_flags_exist(with_leader()) == []


@pytest.mark.parametrize("extra,flag", [(["--disable-log-requests"], "--disable-log-requests"),
                                        (["--no-such-flag=3"], "--no-such-flag")])
def test_an_unknown_flag_is_named(extra, flag):
    problems = vllm_flags_exist(with_leader(extra=extra))
    assert len(problems) == 1 and flag in problems[0] and "LeaderWorkerSet llm/g" in problems[0]


def test_a_tag_without_a_flag_list_or_an_untagged_image_is_a_problem():
    assert not (FLAGS_DIR / "v0.11.0.txt").exists()
    [p] = vllm_flags_exist(with_leader(image=f"{IMAGE}:v0.11.0"))
    assert "no flag list" in p and "v0.11.0" in p
    [p] = vllm_flags_exist(with_leader(image=IMAGE))
    assert "not a tagged" in p

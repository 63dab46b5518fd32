"""Workloads for the load tests and the routing lab.

Prompts, their token counting and the synthetic vocabulary: loadtest/prompts.py.

Workload kinds:

- ``random``: vLLM's random dataset in the LEGACY semantics (benchmark_serving.py <= ~v0.8, the
  version the article used): input and output lengths are drawn uniformly from the integers in
  [int(ratio * L), L]; one prefix of ``prefix_len`` tokens is generated once and shared by all
  prompts; prompt = prefix + input. (The newer ``vllm bench serve`` draws from
  [L(1-r), L(1+r)] instead; the article's totals only fit the legacy form.)
- ``sharegpt``: a ShareGPT-format JSON file given by path (list of ``{"conversations": [{"from",
  "value"}, ...]}``), sampled like vLLM: shuffled with the seed, first turn is the prompt, the
  second turn's length is the output length, too-short / too-long pairs pruned.
- ``shared-prefix``: multi-tenant: ``num_groups`` long system prompts, ``users_per_group`` users
  each; every request is one user's question after its tenant's system prompt, so requests of a
  tenant share a long prefix (where prefix-cache affinity matters).
- ``chat-reasoning``, ``multi-turn``, ``long-tail``: production-like mixes (loadtest/mixes.py).
- ``trace``: a JSONL trace of your own traffic, lengths or prompts, prefix groups, arrival times
  (loadtest/traces.py; example: loadtest/examples/trace.jsonl).

Everything is deterministic for a given seed.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from loadtest.mixes import BUILDERS
from loadtest.prompts import PromptSpec, join_parts, random_words
from loadtest.traces import trace_workload


# `make demo` runs the article's workload scaled down by DEMO_SCALE: every length / DEMO_SCALE (the
# `demo` workload) on simulators with the KV capacity / DEMO_SCALE (`python -m local.stack demo`),
# at the article's concurrency. Queueing for KV blocks, which is what routing changes, then happens
# as in the article, in 1/DEMO_SCALE of the time (measured in the lab: least request vs picker
# within a few points of the full-size gap). The demo's simulators then have 391 KV blocks a group.
DEMO_SCALE = 6
# The article's run: vllm benchmark_serving.py --dataset-name random --random-prefix-len 1000
# --random-input-len 4000 --random-output-len 3000 --random-range-ratio 0.2
# --num-prompts 300 --max-concurrency 30.
ARTICLE_RUN = dict(kind="random", prefix_len=1000, input_len=4000, output_len=3000, range_ratio=0.2,
               num_prompts=300, concurrency=30)

# Run settings live in the workloads too (the runners read them); build_workload ignores them.
RUN_KEYS = ("num_prompts", "concurrency", "request_rate", "burstiness", "endpoint")

WORKLOADS: dict[str, dict] = {
    "article": ARTICLE_RUN,
    # Local demo (`make demo`, see DEMO_SCALE), half the article's prompts. BENCHMARKS.md has its
    # figures and its lab cross-check. Against full-size simulators (`make up`) it barely loads them.
    "demo": {**ARTICLE_RUN, **{k: ARTICLE_RUN[k] // DEMO_SCALE for k in ("prefix_len", "input_len", "output_len")},
             "num_prompts": 150},
    # Seconds-long sanity run.
    "smoke": dict(kind="random", prefix_len=16, input_len=64, output_len=16,
                  range_ratio=0.5, num_prompts=12, concurrency=4),
    # Legacy vLLM defaults for the random dataset.
    "random": dict(kind="random", prefix_len=0, input_len=1024, output_len=128,
                   range_ratio=1.0, num_prompts=1000, concurrency=None),
    # Multi-tenant shared system prompts, shaped like the llm-d prefix-cache benchmarks (many
    # customers x a few users, long system prompts, questions 1/5 of the prompt) and sized on
    # the a10-qwq32b engine model (37.6k KV tokens per group, 3 groups): 12 tenants x 4,000 tokens = 48k
    # distinct prefix tokens, more than one group's KV cache (so a group that serves every
    # tenant keeps evicting system prompts) but well within the pool's 113k (a group that
    # serves a third of the tenants keeps theirs, 16k tokens, plus the KV of its ~10 running
    # requests). Concurrency 30 (the article's) queues: prefill is the bottleneck.
    "shared-prefix": dict(kind="shared-prefix", num_groups=12, users_per_group=5,
                          system_prompt_len=4000, question_len=800, output_len=300,
                          num_prompts=400, concurrency=30),
    # ShareGPT file by path (no download): build_workload("sharegpt", path="...").
    "sharegpt": dict(kind="sharegpt", path=None, output_len=None, keep_long=False,
                     num_prompts=300, concurrency=30),
    # ShareGPT without vLLM's 2k-context pruning: prompts and answers up to a 16k context.
    "sharegpt-long": dict(kind="sharegpt", path=None, output_len=None, keep_long=True,
                          num_prompts=300, concurrency=30),
    # A reasoning model's traffic: 70 % short chat, 30 % long reasoning (lengths in tokens).
    "chat-reasoning": dict(kind="chat-reasoning", long_share=0.3, short_input=(100, 600),
                           short_output=(50, 400), long_input=(2000, 6000),
                           long_output=(1500, 4000), num_prompts=300, concurrency=30),
    # 60 chat sessions x 5 turns resending their history (one 500-token system prompt; the
    # 5th turn is ~3,000 tokens); the sessions' histories (~200k tokens) exceed 3 groups' KV.
    "multi-turn": dict(kind="multi-turn", num_sessions=60, turns=5, system_prompt_len=500,
                       user_len=(50, 400), output_len=(100, 800), num_prompts=300,
                       concurrency=30),
    # Lognormal lengths (median 1,000 in / 400 out, sigma 1): most requests short, a few huge.
    "long-tail": dict(kind="long-tail", input_median=1000, input_sigma=1.0, output_median=400,
                      output_sigma=1.0, max_model_len=16384, num_prompts=400, concurrency=30),
    # A JSONL trace by path (loadtest/traces.py); every line unless num_prompts is given.
    "trace": dict(kind="trace", path=None, num_prompts=None, concurrency=30),
    # Class mixes (loadtest/mixes.py class_mix_workload): answer lengths that differ by class,
    # each class visible only through what a real request carries, every client sending the same
    # max_tokens cap and prompts of the same lengths. Classes: (name, share, length distribution,
    # client id, own system prompt, extra body fields).
    # The class shows only in the client id: three applications behind three API keys.
    "client-mix": dict(kind="class-mix", classes=(
        ("chat", 0.5, ("lognormal", 150, 0.6, 8, 8192), "chat-app", False, None),
        ("agent", 0.3, ("lognormal", 700, 0.6, 16, 8192), "agent-app", False, None),
        ("reasoner", 0.2, ("lognormal", 3000, 0.5, 64, 9000), "reasoner-app", False, None)),
        prompt_len=("lognormal", 1500, 0.6, 64, 6000), template_len=0, cap=9000,
        num_prompts=300, concurrency=30),
    # The class shows only in the system prompt: one client, eight templates (600-token system
    # prompts) whose answers run from ~80 to ~4,000 tokens.
    "template-mix": dict(kind="class-mix", classes=tuple(
        (f"template-{i}", 1.0, ("lognormal", m, 0.5, 8, 10000), "app", True, None)
        for i, m in enumerate((80, 140, 250, 450, 800, 1400, 2500, 4000))),
        prompt_len=("lognormal", 800, 0.6, 32, 4000), template_len=600, cap=10000,
        num_prompts=300, concurrency=30),
    # Nothing predicts the length: one class, heavy-tailed answers, random prompts.
    "no-signal": dict(kind="class-mix", classes=(
        ("answer", 1.0, ("lognormal", 700, 1.0, 8, 10000), "app", False, None),),
        prompt_len=("lognormal", 1500, 0.6, 64, 6000), template_len=0, cap=10000,
        num_prompts=300, concurrency=30),
    # A reasoning model's two kinds of answers, the class visible in the thinking switch
    # (chat_template_kwargs.enable_thinking): short chat answers (lognormal, median 200) and
    # heavy-tailed reasoning (log-t with 3 degrees of freedom, median 2,500).
    "reasoning-mix": dict(kind="class-mix", classes=(
        ("chat", 0.6, ("lognormal", 200, 0.8, 8, 8000), "app", False,
         {"chat_template_kwargs": {"enable_thinking": False}}),
        ("reasoning", 0.4, ("logt", 2500, 0.6, 3, 64, 10000), "app", False,
         {"chat_template_kwargs": {"enable_thinking": True}})),
        prompt_len=("lognormal", 1000, 0.7, 32, 6000), template_len=0, cap=10000,
        num_prompts=300, concurrency=30),
}

_KIND_PARAMS = {
    "random": {"prefix_len", "input_len", "output_len", "range_ratio"},
    "shared-prefix": {"num_groups", "users_per_group", "system_prompt_len", "question_len",
                      "output_len"},
    "sharegpt": {"path", "output_len", "keep_long"},
    "chat-reasoning": {"long_share", "short_input", "short_output", "long_input", "long_output"},
    "multi-turn": {"num_sessions", "turns", "system_prompt_len", "user_len", "output_len"},
    "long-tail": {"input_median", "input_sigma", "output_median", "output_sigma", "max_model_len"},
    "trace": {"path"},
    "class-mix": {"classes", "prompt_len", "template_len", "cap"},
}

# Any workload: `cap` = the max_tokens every request sends instead of its length (at least the
# length; the length then goes as min_tokens, loadtest/openai_api.py), as real clients send caps.
COMMON_PARAMS = {"cap"}


def workload_settings(name: str, **overrides) -> dict:
    """The named workload's settings with overrides applied (None overrides are ignored)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(sorted(WORKLOADS))}")
    settings = dict(WORKLOADS[name])
    allowed = _KIND_PARAMS[settings["kind"]] | set(RUN_KEYS) | COMMON_PARAMS
    for key, value in overrides.items():
        if key not in allowed:
            raise ValueError(f"workload {name!r} ({settings['kind']}) has no parameter {key!r}; "
                             f"allowed: {', '.join(sorted(allowed))}")
        if value is not None:
            settings[key] = value
    return settings


def build_workload(name: str, *, seed: int = 0, **overrides) -> list[PromptSpec]:
    """Build the prompts of workload `name` (see WORKLOADS), deterministic for `seed`."""
    s = workload_settings(name, **overrides)
    specs = _build(s, seed)
    cap = s.get("cap")
    if cap is not None and s["kind"] != "class-mix":    # a class mix applies its own
        specs = [replace(p, cap=max(int(cap), p.output_tokens)) if p.cap is None else p
                 for p in specs]
    return specs


def _build(s: dict, seed: int) -> list[PromptSpec]:
    if s["kind"] == "trace":
        return trace_workload(seed, s["path"], s["num_prompts"])
    rng = np.random.default_rng(seed)
    n = int(s["num_prompts"])
    if n <= 0:
        raise ValueError("num_prompts must be positive")
    if s["kind"] in MIX_KINDS:
        return BUILDERS[s["kind"]](rng, n, **{k: s[k] for k in _KIND_PARAMS[s["kind"]]})
    if s["kind"] == "random":
        return random_workload(rng, n, s["prefix_len"], s["input_len"], s["output_len"],
                               s["range_ratio"])
    if s["kind"] == "shared-prefix":
        return shared_prefix_workload(rng, n, s["num_groups"], s["users_per_group"],
                                      s["system_prompt_len"], s["question_len"], s["output_len"])
    keep_long = s["keep_long"]
    if isinstance(keep_long, str):          # from --workload-args keep_long=true
        keep_long = keep_long.strip().lower() in ("1", "true", "yes")
    return sharegpt_workload(rng, n, s["path"], s["output_len"], bool(keep_long))


MIX_KINDS = ("chat-reasoning", "multi-turn", "long-tail", "class-mix")   # loadtest/mixes.py


def random_workload(rng: np.random.Generator, num_prompts: int, prefix_len: int,
                    input_len: int, output_len: int, range_ratio: float) -> list[PromptSpec]:
    """vLLM's legacy random dataset: lengths uniform on integers [int(r*L), L]."""
    if not 0 <= range_ratio <= 1:
        raise ValueError(f"range_ratio must be in [0, 1], got {range_ratio}")
    if input_len < 0 or output_len < 1 or prefix_len < 0:
        raise ValueError("need prefix_len >= 0, input_len >= 0, output_len >= 1")
    input_lens = rng.integers(int(input_len * range_ratio), input_len + 1, size=num_prompts)
    # max_tokens must be >= 1, so an output length of 0 (ratio 0) becomes 1.
    output_lens = np.maximum(
        1, rng.integers(int(output_len * range_ratio), output_len + 1, size=num_prompts))
    prefix = random_words(rng, prefix_len)
    dist = ("uniform", max(1, int(output_len * range_ratio)), output_len)
    return [PromptSpec(prompt=join_parts(prefix, random_words(rng, int(i))),
                       prompt_tokens=prefix_len + int(i), output_tokens=int(o),
                       length_class="answer", length_dist=dist)
            for i, o in zip(input_lens, output_lens)]


def shared_prefix_workload(rng: np.random.Generator, num_prompts: int, num_groups: int,
                           users_per_group: int, system_prompt_len: int, question_len: int,
                           output_len: int) -> list[PromptSpec]:
    """Tenants with long system prompts; each request: a random user of a random tenant."""
    if num_groups < 1 or users_per_group < 1 or output_len < 1:
        raise ValueError("need num_groups >= 1, users_per_group >= 1, output_len >= 1")
    systems = [random_words(rng, system_prompt_len) for _ in range(num_groups)]
    groups = rng.integers(0, num_groups, size=num_prompts)
    users = rng.integers(0, users_per_group, size=num_prompts)
    specs = []
    for g, u in zip(groups.tolist(), users.tolist()):
        question = random_words(rng, question_len)
        specs.append(PromptSpec(
            prompt=join_parts(systems[g], question),
            prompt_tokens=system_prompt_len + question_len, output_tokens=output_len,
            group=f"tenant-{g}", length_class="answer", length_dist=("const", output_len),
            messages=[{"role": "system", "content": systems[g]},
                      {"role": "user", "content": question, "name": f"user-{g}-{u}"}]))
    return specs


# ShareGPT pruning: vLLM's benchmark (for 2k-context models), and with keep_long a 16k context.
SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL = 1024, 2048
LONG_CONTEXT = 16384


def sharegpt_workload(rng: np.random.Generator, num_prompts: int, path: str | None,
                      output_len: int | None = None, keep_long: bool = False) -> list[PromptSpec]:
    """Sample a ShareGPT-format file like vLLM's sample_sharegpt_requests (word counts).

    vLLM prunes prompts over 1,024 tokens and pairs over 2,048; keep_long keeps every pair that
    fits a 16,384-token context (a reasoning model's long prompts and answers)."""
    if not path:
        raise ValueError("the sharegpt workload needs path=<ShareGPT JSON file>")
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read ShareGPT file {path}: {err}") from err
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations")
    pairs = [(c["conversations"][0]["value"], c["conversations"][1]["value"])
             for c in data
             if isinstance(c, dict) and len(c.get("conversations") or []) >= 2]
    order = rng.permutation(len(pairs))
    specs = []
    for idx in order.tolist():
        prompt_words = pairs[idx][0].split()
        out = output_len if output_len else len(pairs[idx][1].split())
        # vLLM's pruning: too short, or too long for a 2k-context model.
        if len(prompt_words) < 4 or (output_len is None and out < 4):
            continue
        max_prompt, max_total = ((LONG_CONTEXT, LONG_CONTEXT) if keep_long
                                 else (SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL))
        if len(prompt_words) > max_prompt or len(prompt_words) + out > max_total:
            continue
        prompt = " ".join(prompt_words)
        specs.append(PromptSpec(prompt=prompt, prompt_tokens=len(prompt_words),
                                output_tokens=int(out)))
        if len(specs) == num_prompts:
            break
    if not specs:
        raise ValueError(f"{path}: no usable conversations (need >= 2 turns, 4.."
                         f"{LONG_CONTEXT if keep_long else SHAREGPT_MAX_PROMPT} words)")
    return specs

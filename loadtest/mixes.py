"""Workloads shaped like production traffic rather than a benchmark's uniform draws.

- ``chat-reasoning``: a mix of short chat turns and long reasoning requests (a reasoning model
  serves both): a share ``long_share`` of requests draws input and output lengths uniformly from
  the long ranges, the rest from the short ones.
- ``multi-turn``: chat sessions that resend their growing history: turn k of a session is its
  system prompt + every earlier user message and answer + a new user message. Requests go out
  round by round (every session's turn 1 in a random order, then every turn 2, ...), so with
  more sessions than the client's concurrency a session's next turn is sent after its previous
  one finished, as a user would. A session is a prefix group (its history is the shared prefix).
- ``long-tail``: lognormal input and output lengths (median and sigma given), a long tail of big
  prompts and long answers as in real chat logs, cut to the model's context.

Lengths are in tokens (1 synthetic word = 1 token), deterministic for a seed.
"""
from __future__ import annotations

import numpy as np

from loadtest.prompts import PromptSpec, random_words


def _uniform(rng: np.random.Generator, bounds, size: int) -> np.ndarray:
    lo, hi = bounds
    if not 1 <= lo <= hi:
        raise ValueError(f"length range must satisfy 1 <= low <= high, got {bounds}")
    return rng.integers(int(lo), int(hi) + 1, size=size)


def chat_reasoning_workload(rng: np.random.Generator, num_prompts: int, long_share: float,
                            short_input, short_output, long_input, long_output) -> list:
    if not 0 <= long_share <= 1:
        raise ValueError(f"long_share must be in [0, 1], got {long_share}")
    is_long = rng.random(num_prompts) < long_share
    ins = np.where(is_long, _uniform(rng, long_input, num_prompts),
                   _uniform(rng, short_input, num_prompts))
    outs = np.where(is_long, _uniform(rng, long_output, num_prompts),
                    _uniform(rng, short_output, num_prompts))
    dists = {"chat": ("uniform", *short_output), "reasoning": ("uniform", *long_output)}
    return [PromptSpec(prompt=random_words(rng, int(i)), prompt_tokens=int(i), output_tokens=int(o),
                       group="reasoning" if long else "chat",
                       length_class="reasoning" if long else "chat",
                       length_dist=dists["reasoning" if long else "chat"])
            for i, o, long in zip(ins, outs, is_long)]


def multi_turn_workload(rng: np.random.Generator, num_prompts: int, num_sessions: int, turns: int,
                        system_prompt_len: int, user_len, output_len) -> list:
    if num_sessions < 1 or turns < 1:
        raise ValueError("need num_sessions >= 1 and turns >= 1")
    system = random_words(rng, system_prompt_len)        # one application: the same system prompt
    history = [system] * num_sessions
    specs = []
    for _ in range(turns):
        for s in rng.permutation(num_sessions).tolist():
            user = random_words(rng, int(_uniform(rng, user_len, 1)[0]))
            prompt = " ".join(p for p in (history[s], user) if p)
            out = int(_uniform(rng, output_len, 1)[0])
            specs.append(PromptSpec(prompt=prompt, prompt_tokens=len(prompt.split(" ")),
                                    output_tokens=out, group=f"session-{s}", length_class="turn",
                                    length_dist=("uniform", *output_len)))
            # The answer joins the history the next turn resends (synthetic words of its length).
            history[s] = " ".join((prompt, random_words(rng, out)))
            if len(specs) == num_prompts:
                return specs
    return specs


def long_tail_workload(rng: np.random.Generator, num_prompts: int, input_median: float,
                       input_sigma: float, output_median: float, output_sigma: float,
                       max_model_len: int) -> list:
    ins = np.clip(rng.lognormal(np.log(input_median), input_sigma, num_prompts), 4,
                  max_model_len // 2).astype(int)
    outs = np.clip(rng.lognormal(np.log(output_median), output_sigma, num_prompts), 4,
                   max_model_len - ins).astype(int)
    dist = ("lognormal", output_median, output_sigma, 4, max_model_len)
    return [PromptSpec(prompt=random_words(rng, int(i)), prompt_tokens=int(i), output_tokens=int(o),
                       length_class="answer", length_dist=dist)
            for i, o in zip(ins, outs)]


def class_mix_workload(rng: np.random.Generator, num_prompts: int, classes, prompt_len,
                       template_len: int, cap) -> list:
    """Requests of several classes whose answer lengths differ, each class showing itself (or
    not) only through what a real request would carry.

    classes: (name, share, length distribution (loadtest/lengths.py), client id ("" = none),
    template (True: the class's own system prompt of `template_len` words opens its prompts),
    extra body fields (dict or None)) per class; prompt_len: the distribution of the prompts'
    own lengths (the same for every class, so the length shows nothing); cap: the max_tokens
    every client sends (None: the true length, as vLLM's benchmark)."""
    from loadtest import lengths
    if not classes:
        raise ValueError("a class mix needs at least one class")
    shares = np.array([float(c[1]) for c in classes])
    if (shares < 0).any() or shares.sum() <= 0:
        raise ValueError("class shares must be >= 0 and not all 0")
    for c in classes:
        lengths.check(tuple(c[2]))
    which = rng.choice(len(classes), size=num_prompts, p=shares / shares.sum())
    templates = [random_words(rng, template_len) if c[4] else "" for c in classes]
    prompt_lens = lengths.sample(tuple(prompt_len), rng, num_prompts)
    specs = []
    for k, plen in zip(which.tolist(), prompt_lens.tolist()):
        name, _, dist, client, _, extra = classes[k]
        dist = tuple(dist)
        out = int(lengths.sample(dist, rng, 1)[0])
        question = random_words(rng, int(plen))
        prompt = " ".join(p for p in (templates[k], question) if p)
        specs.append(PromptSpec(prompt=prompt, prompt_tokens=len(prompt.split(" ")),
                                output_tokens=out, group=name, client=client,
                                cap=None if cap is None else max(int(cap), out),
                                extra=dict(extra) if extra else None, length_class=name,
                                length_dist=dist))
    return specs


BUILDERS = {"chat-reasoning": chat_reasoning_workload, "multi-turn": multi_turn_workload,
            "long-tail": long_tail_workload, "class-mix": class_mix_workload}

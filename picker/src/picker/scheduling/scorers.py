"""Scorers: each maps (context, candidate endpoints) to scores in [0, 1], higher is better.

A scorer is built from its profile parameters by a factory registered under a name. Stale
metrics count as unknown-and-saturated: the worst score on every load signal.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from picker.scheduling.context import SchedulingContext
from picker.signals.state import EndpointState

Scorer = Callable[[SchedulingContext, list[EndpointState]], list[float]]


def _spread(values: list[float]) -> list[float]:
    """(max - v) / (max - min); all 1.0 when equal (upstream queue-scorer normalisation)."""
    lo, hi = min(values), max(values)
    if hi == lo:
        return [1.0] * len(values)
    span = hi - lo
    return [(hi - v) / span for v in values]


def queue_scorer(include_inflight: bool = False) -> Scorer:
    """Waiting queue, min-max normalised over the candidates (upstream `queue-scorer`)."""
    def score(ctx: SchedulingContext, eps: list[EndpointState]) -> list[float]:
        qs = []
        for e in eps:
            if e.stale or e.metrics is None:
                qs.append(math.inf)
                continue
            q = e.metrics.waiting
            if include_inflight:
                q += e.since_scrape
            qs.append(q)
        finite = [q for q in qs if q != math.inf]
        if not finite:
            return [0.0] * len(eps)
        worst = max(finite) + 1.0
        return _spread([worst if q == math.inf else q for q in qs])
    return score


def kv_cache_scorer(include_inflight: bool = False) -> Scorer:
    """1 - KV-cache usage (upstream `kv-cache-utilization-scorer`)."""
    def score(ctx: SchedulingContext, eps: list[EndpointState]) -> list[float]:
        out = []
        for e in eps:
            m = e.metrics
            if e.stale or m is None:
                out.append(0.0)
                continue
            kv = m.kv_usage
            cap = m.kv_capacity_tokens
            if include_inflight and cap:
                kv += e.since_scrape_tokens / cap
            out.append(max(0.0, 1.0 - kv))
        return out
    return score


def prefix_cache_scorer() -> Scorer:
    """Share of the prompt's blocks the endpoint is believed to hold (upstream `prefix-cache-scorer`)."""
    def score(ctx: SchedulingContext, eps: list[EndpointState]) -> list[float]:
        total = len(ctx.hashes)
        if total == 0:
            return [0.0] * len(eps)
        match = ctx.prefix_match
        return [match.get(e.address, 0) / total for e in eps]
    return score


def precise_prefix_scorer() -> Scorer:
    """Share of the prompt cached on the endpoint: from its KV-cache events where they are in
    sync (scheduling/precise.py), else the approximate index's share (as `prefix-cache`)."""
    def score(ctx: SchedulingContext, eps: list[EndpointState]) -> list[float]:
        total = len(ctx.hashes)
        precise, sync = ctx.precise, ctx.sync
        if precise is None:
            if total == 0:
                return [0.0] * len(eps)
            match = ctx.prefix_match
            return [match.get(e.address, 0) / total for e in eps]
        out = []
        for e in eps:
            a = e.address
            if sync.get(a) == "":
                out.append(ctx.cached_tokens(a) / ctx.prompt_tokens if ctx.prompt_tokens else 0.0)
            else:
                out.append(ctx.prefix_match.get(a, 0) / total if total else 0.0)
        return out
    return score


def inflight_load_scorer() -> Scorer:
    """Requests the picker sent and has not seen finish, min-max normalised."""
    def score(ctx: SchedulingContext, eps: list[EndpointState]) -> list[float]:
        return _spread([float(e.inflight) for e in eps])
    return score


def lora_affinity_scorer() -> Scorer:
    """1.0 adapter active, 0.8 free adapter slot, 0.6 adapter waiting, else 0 (upstream values).

    Endpoints without LoRA metrics, or serving the target as a base model, score 1.0.
    """
    def score(ctx: SchedulingContext, eps: list[EndpointState]) -> list[float]:
        target = ctx.target_model
        out = []
        for e in eps:
            m = e.metrics
            if m is None or m.lora_max is None or target in m.models:
                out.append(1.0)
            elif target in m.lora_running:
                out.append(1.0)
            elif len(m.lora_running) < m.lora_max:
                out.append(0.8)
            elif target in m.lora_waiting:
                out.append(0.6)
            else:
                out.append(0.0)
        return out
    return score


KV_PRESSURE = 0.5  # KV usage at which a prefix miss costs miss_weight times its tokens


def predicted_ttft_cost(ctx: SchedulingContext, e: EndpointState, running_tokens: float,
                        kv_wait_tokens: float, output_reserve_tokens: int,
                        miss_weight: float = 1.0, wait: WaitModel | None = None) -> float:
    """Prefill work (in tokens) this request would wait for and do on endpoint e.

    queue ahead:  waiting requests (size unknown: the recent mean prompt) plus the prompt tokens
                  the picker sent since the last scrape (not yet in the server's numbers);
    batch:        running requests slow every engine step (running_tokens each);
    own prefill:  prompt tokens not already in the endpoint's prefix cache, times miss_weight:
                  in a loaded pool those tokens are also work every later request on that
                  endpoint waits for, and their blocks displace other prompts' cached
                  prefixes, so a miss costs the pool more than this request's own wait;
    admission:    if the KV cache cannot hold the uncached prompt now, a wait of kv_wait_tokens
                  plus the shortfall (requests must finish before blocks free up);
    predicted:    with a wait model (`predicted_wait`) and learned output lengths
                  (picker.lengths), a share of the decode time until the running requests'
                  predicted ends free enough KV for it behind the queue, in prefill tokens.
    """
    m = e.metrics
    if m is None or e.stale:
        return math.inf
    uncached = ctx.prompt_tokens - ctx.cached_tokens(e.address)
    capacity = m.kv_capacity_tokens
    # A miss displaces other prompts' cached blocks only when the KV cache is under pressure: on
    # an empty cache it costs just its own prefill. Without this, a burst sharing a prefix no
    # group holds yet piles onto the first group that got it (cold start).
    used = m.kv_usage + (e.since_scrape_tokens / capacity if capacity else 0.0)
    weight = 1.0 + (miss_weight - 1.0) * min(1.0, used / KV_PRESSURE)
    ahead = m.waiting * ctx.avg_prompt_tokens + e.since_scrape_tokens
    cost = ahead + m.running * running_tokens + weight * uncached
    if wait is not None and ctx.projection is not None:
        # Learned output lengths (picker.lengths): the decode steps until the running requests'
        # predicted ends free KV for this request behind the queue there, in prefill tokens.
        projection = ctx.projection(e)
        need = uncached * projection.token_ratio + output_reserve_tokens
        cost += wait.weight * wait.tokens_per_second * projection.wait_seconds(need)
    if capacity:
        free = (1.0 - m.kv_usage) * capacity - e.since_scrape_tokens
        need = uncached + output_reserve_tokens
        if need > free:
            cost += kv_wait_tokens + (need - max(free, 0.0))
    elif m.kv_usage >= 0.95:
        cost += kv_wait_tokens
    return cost


@dataclass(frozen=True, slots=True)
class WaitModel:
    """How predicted-ttft adds the wait for KV from the running requests' predicted ends
    (picker.lengths; `predicted_wait` in a profile).

    tokens_per_second: prefill tokens an engine computes per second: converts the wait into the
                       cost's units (the A10 QwQ-32B groups: ~1,600);
    weight:            the share of that wait added to the cost. Beside the fixed admission
                       term, not instead of it: tuned with the routing lab (picker/README.md,
                       "Output lengths")."""
    tokens_per_second: float = 1600.0
    weight: float = 0.5

    def __post_init__(self):
        if self.tokens_per_second <= 0 or self.weight < 0:
            raise ValueError("predicted_wait: tokens_per_second must be > 0 and weight >= 0")


def predicted_ttft_scorer(running_tokens: float = 16.0, kv_wait_tokens: float = 8192.0,
                          output_reserve_tokens: int = 256, miss_weight: float = 1.0,
                          predicted_wait: dict | None = None) -> Scorer:
    """Scores min_cost / cost over the candidates, cost = predicted_ttft_cost (+1 block).
    `predicted_wait` (a WaitModel's fields) turns on the wait from predicted ends."""
    wait = WaitModel(**predicted_wait) if predicted_wait is not None else None

    def score(ctx: SchedulingContext, eps: list[EndpointState]) -> list[float]:
        costs = [predicted_ttft_cost(ctx, e, running_tokens, kv_wait_tokens, output_reserve_tokens,
                                    miss_weight, wait)
                 + ctx.block_size_tokens for e in eps]
        best = min(costs)
        if best == math.inf:
            return [0.0] * len(eps)
        return [best / c for c in costs]
    return score

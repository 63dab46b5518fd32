"""Filters: narrow the candidate endpoints; a filter that would drop all of them keeps all."""
from __future__ import annotations

from typing import Callable

from picker import defaults
from picker.scheduling.context import SchedulingContext
from picker.scheduling.saturation import SaturationThresholds, endpoint_saturation
from picker.signals.state import EndpointState

Filter = Callable[[SchedulingContext, list[EndpointState]], list[EndpointState]]


def _keep_nonempty(kept: list[EndpointState], eps: list[EndpointState]) -> list[EndpointState]:
    return kept or eps


def saturation_filter(queue_depth: float = defaults.SATURATION_QUEUE_DEPTH,
                      kv_cache_util: float = defaults.SATURATION_KV_CACHE_UTIL) -> Filter:
    """Drop stale endpoints and those at or over the queue or KV threshold (upstream detector)."""
    t = SaturationThresholds(queue_depth, kv_cache_util)

    def run(ctx: SchedulingContext, eps: list[EndpointState]) -> list[EndpointState]:
        return _keep_nonempty([e for e in eps if endpoint_saturation(e, t) < 1.0], eps)
    return run


def kv_headroom_filter(output_reserve_tokens: int = 256) -> Filter:
    """Keep endpoints whose KV cache can admit the uncached prompt now (needs cache_config_info)."""
    def run(ctx: SchedulingContext, eps: list[EndpointState]) -> list[EndpointState]:
        kept = []
        for e in eps:
            m = e.metrics
            cap = m.kv_capacity_tokens if m else None
            if m is None or e.stale:
                continue
            if not cap:
                kept.append(e)
                continue
            free = (1.0 - m.kv_usage) * cap - e.since_scrape_tokens
            need = ctx.prompt_tokens - ctx.cached_tokens(e.address) + output_reserve_tokens
            if need <= free:
                kept.append(e)
        return _keep_nonempty(kept, eps)
    return run


def fresh_filter() -> Filter:
    """Drop endpoints whose metrics are stale."""
    def run(ctx: SchedulingContext, eps: list[EndpointState]) -> list[EndpointState]:
        return _keep_nonempty([e for e in eps if not e.stale], eps)
    return run

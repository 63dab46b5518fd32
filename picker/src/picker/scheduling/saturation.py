"""Saturation per endpoint and for the pool, as the upstream utilization detector defines it."""
from __future__ import annotations

from dataclasses import dataclass

from picker import defaults
from picker.signals.state import EndpointState


@dataclass(frozen=True, slots=True)
class SaturationThresholds:
    queue_depth: float = defaults.SATURATION_QUEUE_DEPTH
    kv_cache_util: float = defaults.SATURATION_KV_CACHE_UTIL


def endpoint_saturation(state: EndpointState, t: SaturationThresholds) -> float:
    m = state.metrics
    if m is None or state.stale or state.failing:
        return 1.0  # unknown counts as saturated
    return max(m.waiting / t.queue_depth, m.kv_usage / t.kv_cache_util)


def pool_saturation(endpoints: list[EndpointState], t: SaturationThresholds) -> float:
    if not endpoints:
        return 1.0
    return sum(endpoint_saturation(e, t) for e in endpoints) / len(endpoints)

"""When an endpoint can start a request now: the picker's saturation test for flow control.

An endpoint has room for a request when, from the signals the picker has:
- its metrics are fresh (a stale or failing endpoint is unknown, not free);
- its engine had at most `max_engine_waiting` requests waiting at the last scrape (vLLM's
  `num_requests_waiting`: with a queue, the engine cannot start more now);
- its KV cache can hold the request's uncached prompt plus `output_reserve_tokens` now: free KV
  tokens ((1 - kv_usage) x block_size x num_gpu_blocks) minus the prompt tokens the picker sent
  there since that scrape (not yet in the engine's numbers). Without `vllm:cache_config_info`
  the test is kv_usage < `kv_usage_without_capacity`.

Requests sent since the last scrape are counted by their tokens, not their number: short
requests that finish between two scrapes must not cap an endpoint at a few per interval.

Holdback (`holdback=True`, decided by the controller): a request that must leave room for others
(a lower priority band while a higher one is active, or, while the pool is saturated, a client
over its share of its band) needs `holdback_fraction` of the endpoint's KV capacity free beyond
its own need. In a saturated pool a slot frees only when a running request ends; without a
reserve the backlog of the heavy client or the low band takes every slot the moment it frees,
and a light or high-priority request waits for the next end however the queue is ordered. The
endpoints with room for a request that holds back are a subset of those with room without it.

Prefix affinity (`affine_without_room`): while some endpoint has room, an endpoint without room
whose cache holds `affinity_tokens` more of the prompt than any endpoint with room stays a
candidate (not for a request that holds back).
"""
from __future__ import annotations

from dataclasses import dataclass

from picker import defaults
from picker.scheduling.context import SchedulingContext
from picker.signals.state import EndpointState


@dataclass(frozen=True, slots=True)
class RoomRule:
    max_engine_waiting: int = defaults.FLOW_MAX_ENGINE_WAITING
    output_reserve_tokens: int = defaults.FLOW_OUTPUT_RESERVE
    kv_usage_without_capacity: float = 0.9
    holdback_fraction: float = defaults.FLOW_HOLDBACK
    affinity_tokens: int = defaults.FLOW_AFFINITY_TOKENS

    def __post_init__(self):
        if not 0.0 <= self.holdback_fraction < 1.0:
            raise ValueError("holdback_fraction must be in [0, 1)")


def has_room(e: EndpointState, ctx: SchedulingContext, rule: RoomRule, holdback: bool = False) -> bool:
    m = e.metrics
    if m is None or e.stale or e.failing:
        return False
    if m.waiting > rule.max_engine_waiting:
        return False
    capacity = m.kv_capacity_tokens
    reserve = rule.holdback_fraction if holdback else 0.0
    if not capacity:
        return m.kv_usage < rule.kv_usage_without_capacity - reserve
    free = (1.0 - m.kv_usage) * capacity - e.since_scrape_tokens
    need = ctx.prompt_tokens - ctx.cached_tokens(e.address) + rule.output_reserve_tokens
    if holdback:
        return need + reserve * capacity <= free
    return need <= free or (m.running == 0 and e.since_scrape == 0)  # an idle engine takes anything


def affine_without_room(ctx: SchedulingContext, candidates: list[EndpointState],
                        room: list[EndpointState], rule: RoomRule) -> list[EndpointState]:
    """The candidates without room whose prefix cache holds at least `affinity_tokens` more of
    the prompt than every endpoint with room. Sending the request elsewhere would recompute
    that prefix and store a second copy of it; the scorer weighs it against their load as it
    does without flow control."""
    if not room:
        return []
    best_with_room = max(ctx.cached_tokens(e.address) for e in room)
    return [e for e in candidates if e not in room and not (e.metrics is None or e.stale or e.failing)
            and ctx.cached_tokens(e.address) >= best_with_room + rule.affinity_tokens]

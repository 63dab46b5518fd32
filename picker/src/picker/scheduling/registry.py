"""Name -> factory registries for filters, scorers and pickers; profiles refer to these names.

Other code can add plugins with register_filter / register_scorer / register_picker.
"""
from __future__ import annotations

from typing import Any, Callable

from picker.scheduling import filters, pickers, scorers

FILTERS: dict[str, Callable[..., filters.Filter]] = {
    "saturation": filters.saturation_filter,
    "kv-headroom": filters.kv_headroom_filter,
    "fresh": filters.fresh_filter,
}
SCORERS: dict[str, Callable[..., scorers.Scorer]] = {
    "queue": scorers.queue_scorer,
    "kv-cache-utilization": scorers.kv_cache_scorer,
    "prefix-cache": scorers.prefix_cache_scorer,
    "precise-prefix": scorers.precise_prefix_scorer,
    "inflight-load": scorers.inflight_load_scorer,
    "lora-affinity": scorers.lora_affinity_scorer,
    "predicted-ttft": scorers.predicted_ttft_scorer,
}
PICKERS: dict[str, Callable[..., pickers.Picker]] = {
    "max-score": pickers.max_score_picker,
    "random": pickers.random_picker,
    "weighted-random": pickers.weighted_random_picker,
}
# Scorers that need the prompt's prefix match computed before scoring.
NEEDS_PREFIX = {"prefix-cache", "precise-prefix", "predicted-ttft", "kv-headroom"}


def canonical(name: str) -> str:
    """Accept upstream spellings like `queue-scorer` or `max-score-picker`."""
    for suffix in ("-scorer", "-filter", "-picker"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def build(kind: str, table: dict[str, Callable[..., Any]], name: str, params: dict[str, Any]) -> Any:
    key = canonical(name)
    if key not in table:
        raise ValueError(f"unknown {kind} {name!r}; known: {', '.join(sorted(table))}")
    try:
        return table[key](**params)
    except TypeError as exc:
        raise ValueError(f"bad parameters for {kind} {name!r}: {exc}") from None


def register_filter(name: str, factory: Callable[..., filters.Filter]) -> None:
    FILTERS[name] = factory


def register_scorer(name: str, factory: Callable[..., scorers.Scorer], needs_prefix: bool = False) -> None:
    SCORERS[name] = factory
    if needs_prefix:
        NEEDS_PREFIX.add(name)


def register_picker(name: str, factory: Callable[..., pickers.Picker]) -> None:
    PICKERS[name] = factory

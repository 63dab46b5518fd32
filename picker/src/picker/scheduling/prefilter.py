"""Candidate prefilter: in a large pool, score only the endpoints that can plausibly win.

Scoring every candidate costs time in proportion to the pool (~2.7 us per endpoint per scorer
here). Above `above` candidates the scorers see only:
- the endpoints holding the longest prefix match of the prompt (at most `owners`): the prefix
  scorers' winners;
- `least` endpoints with the lowest load at the last refresh of the least-loaded list (the
  load scorers' likely winners; the list is recomputed at most every `refresh` seconds);
- `sample` endpoints drawn at random: the power-of-d idea, so load spreads even where the
  least-loaded list is a little old.
Below the threshold every candidate is scored, so small pools route exactly as before.
"""
from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

from picker import defaults
from picker.signals.state import EndpointState


@dataclass(frozen=True, slots=True)
class PrefilterSettings:
    above: int = defaults.PREFILTER_ABOVE
    sample: int = defaults.PREFILTER_SAMPLE
    least: int = defaults.PREFILTER_LEAST
    owners: int = defaults.PREFILTER_OWNERS
    refresh: float = 0.005


def load_key(e: EndpointState) -> float:
    """Lower is less loaded: queue first, then running requests and KV usage."""
    m = e.metrics
    if m is None or e.stale:
        return float("inf")
    return (m.waiting + e.since_scrape) * 4.0 + m.running * 0.1 + m.kv_usage


class LeastLoaded:
    """The `k` least-loaded candidates per model, recomputed at most every `refresh` seconds."""

    def __init__(self):
        self._lists: dict[str, tuple[float, int, list[EndpointState]]] = {}

    def get(self, model: str, candidates: list[EndpointState], k: int, now: float,
            refresh: float, version: int) -> list[EndpointState]:
        cached = self._lists.get(model)
        if cached is not None and cached[1] == version and now - cached[0] < refresh:
            return cached[2]
        least = heapq.nsmallest(k, candidates, key=load_key)
        self._lists[model] = (now, version, least)
        return least


def prefilter(candidates: list[EndpointState], by_addr: dict[str, EndpointState],
              prefix_match: dict[str, int], least: list[EndpointState], rng: random.Random,
              s: PrefilterSettings) -> list[EndpointState]:
    """The candidates worth scoring (all of them when there are at most `s.above`).
    `by_addr` maps the candidates' addresses to them."""
    if len(candidates) <= s.above:
        return candidates
    chosen: dict[str, EndpointState] = {}
    if prefix_match:
        owners = (heapq.nlargest(s.owners, prefix_match, key=prefix_match.__getitem__)
                  if len(prefix_match) > s.owners else prefix_match)
        for a in owners:
            e = by_addr.get(a)
            if e is not None:
                chosen[a] = e
    for e in least:
        chosen[e.address] = e
    for e in rng.sample(candidates, min(s.sample, len(candidates))):
        chosen[e.address] = e
    return list(chosen.values())

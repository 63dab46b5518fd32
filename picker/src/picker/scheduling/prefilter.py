"""Candidate prefilter: in a large pool, score only the endpoints that can plausibly win.

Scoring every candidate costs time in proportion to the pool (~2.7 us per endpoint per scorer
here). Above `above` candidates the scorers see only:
- the endpoints holding the longest prefix match of the prompt (at most `owners`): the prefix
  scorers' winners;
- `least` endpoints with the lowest load at their last scrapes (the load scorers' likely
  winners; LeastLoaded keeps them as scrapes arrive);
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


def load_key(e: EndpointState) -> float:
    """Lower is less loaded: queue first, then running requests and KV usage."""
    m = e.metrics
    if m is None:
        return float("inf")
    return (m.waiting + e.since_scrape) * 4.0 + m.running * 0.1 + m.kv_usage


class LeastLoaded:
    """The `k` least-loaded endpoints as of their last scrapes, kept up to date in O(k) per
    scrape (observe), so no decision scans the pool. A member whose load rose stays until the
    scrapes of the others show lower loads: within one scrape interval."""

    def __init__(self, k: int):
        self.k = k
        self.keys: dict[str, float] = {}
        self.states: dict[str, EndpointState] = {}

    def observe(self, e: EndpointState) -> None:
        if self.k <= 0:
            return
        key = load_key(e)
        a = e.address
        if a in self.keys or len(self.keys) < self.k:
            self.keys[a] = key
            self.states[a] = e
            return
        worst = max(self.keys, key=self.keys.__getitem__)
        if key < self.keys[worst]:
            del self.keys[worst], self.states[worst]
            self.keys[a] = key
            self.states[a] = e

    def forget(self, address: str) -> None:
        self.keys.pop(address, None)
        self.states.pop(address, None)

    def members(self) -> list[EndpointState]:
        return list(self.states.values())


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
        if e.address in by_addr:
            chosen[e.address] = e
    for e in rng.sample(candidates, min(s.sample, len(candidates))):
        chosen[e.address] = e
    return list(chosen.values())

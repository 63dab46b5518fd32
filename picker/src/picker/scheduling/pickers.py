"""Pickers: choose one endpoint from the weighted total scores."""
from __future__ import annotations

import random
from typing import Callable

from picker.signals.state import EndpointState

Picker = Callable[[list[float], list[EndpointState], random.Random], EndpointState]


def max_score_picker() -> Picker:
    """Highest total wins; ties broken at random (upstream shuffles, then takes the max)."""
    def pick(totals: list[float], eps: list[EndpointState], rng: random.Random) -> EndpointState:
        best = max(totals)
        top = [e for t, e in zip(totals, eps) if t >= best - 1e-9]
        return top[0] if len(top) == 1 else rng.choice(top)
    return pick


def random_picker() -> Picker:
    def pick(totals: list[float], eps: list[EndpointState], rng: random.Random) -> EndpointState:
        return rng.choice(eps)
    return pick


def weighted_random_picker(temperature: float = 0.1) -> Picker:
    """Random with probability proportional to exp(total / temperature)."""
    import math

    def pick(totals: list[float], eps: list[EndpointState], rng: random.Random) -> EndpointState:
        best = max(totals)
        weights = [math.exp((t - best) / temperature) for t in totals]
        return rng.choices(eps, weights=weights, k=1)[0]
    return pick

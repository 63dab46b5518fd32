"""Answer-length distributions of the workloads' request classes.

A distribution is a small tuple, so PromptSpecs stay hashable and picklable:

- ("const", n)
- ("uniform", low, high)                       integers, both ends included
- ("lognormal", median, sigma, low, high)      clipped to [low, high]
- ("logt", median, scale, df, low, high)       log-Student-t: a heavier tail than lognormal

`sample` draws lengths for a workload; `quantiles` gives a fixed grid of the distribution's
quantiles, which is what the lab's distribution oracle knows of a request (its class's
distribution, not its realised length) and what predictor-accuracy reports compare against.
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

KINDS = ("const", "uniform", "lognormal", "logt")
GRID = 64          # quantiles of a distribution's grid


def check(dist: tuple) -> tuple:
    """The distribution if well formed, else ValueError naming what is wrong."""
    if not dist or dist[0] not in KINDS:
        raise ValueError(f"length distribution {dist!r}: kind must be one of {', '.join(KINDS)}")
    kind, *params = dist
    arity = {"const": 1, "uniform": 2, "lognormal": 4, "logt": 5}[kind]
    if len(params) != arity:
        raise ValueError(f"length distribution {dist!r}: {kind} takes {arity} parameters")
    if kind == "const" and params[0] < 1:
        raise ValueError(f"length distribution {dist!r}: length must be >= 1")
    if kind != "const":
        low, high = params[-2], params[-1]
        if not 1 <= low <= high:
            raise ValueError(f"length distribution {dist!r}: need 1 <= low <= high")
    if kind in ("lognormal", "logt") and (params[0] <= 0 or params[1] <= 0):
        raise ValueError(f"length distribution {dist!r}: median and sigma/scale must be > 0")
    if kind == "logt" and params[2] <= 0:
        raise ValueError(f"length distribution {dist!r}: degrees of freedom must be > 0")
    return dist


def sample(dist: tuple, rng: np.random.Generator, n: int) -> np.ndarray:
    """n integer lengths drawn from the distribution."""
    kind, *p = check(dist)
    if kind == "const":
        return np.full(n, int(p[0]))
    if kind == "uniform":
        return rng.integers(int(p[0]), int(p[1]) + 1, size=n)
    if kind == "lognormal":
        median, sigma, low, high = p
        x = rng.lognormal(math.log(median), sigma, n)
    else:
        median, scale, df, low, high = p
        x = median * np.exp(scale * rng.standard_t(df, n))
    return np.clip(np.round(x), low, high).astype(int)


@lru_cache(maxsize=256)
def quantiles(dist: tuple) -> tuple[float, ...]:
    """The distribution's quantiles at (i + 0.5) / GRID, i = 0..GRID-1 (by sampling for the log-t,
    exactly otherwise)."""
    kind, *p = check(dist)
    levels = (np.arange(GRID) + 0.5) / GRID
    if kind == "const":
        return (float(p[0]),) * GRID
    if kind == "uniform":
        return tuple(float(v) for v in p[0] + levels * (p[1] - p[0]))
    if kind == "lognormal":
        from statistics import NormalDist
        median, sigma, low, high = p
        z = [NormalDist().inv_cdf(float(u)) for u in levels]
        return tuple(float(min(high, max(low, median * math.exp(sigma * v)))) for v in z)
    rng = np.random.default_rng(0)
    draws = np.sort(sample(dist, rng, 200_000))
    return tuple(float(draws[int(u * len(draws))]) for u in levels)


def residual(dist: tuple, produced: float) -> float:
    """Expected tokens still to come from a request of this class that has produced `produced`
    and not ended: the mean excess over `produced` of the quantiles above it (1 past them all)."""
    left = [q - produced for q in quantiles(dist) if q > produced]
    return sum(left) / len(left) if left else 1.0


def median(dist: tuple) -> float:
    q = quantiles(dist)
    return 0.5 * (q[GRID // 2 - 1] + q[GRID // 2])

"""A day-shaped trace for the autoscaling lab: night trough, morning ramp, peak, lunch dip,
afternoon with a burst, evening decline. Requests of the article's shape (a shared 1,000-token
system prompt + ~4,000 tokens, ~3,000 output tokens, +-20 %), arrivals a Poisson process whose
rate follows the day (thinning). Written as a loadtest trace (loadtest/traces.py), so
`python -m lab plan --trace FILE` and the load tests replay it.

    python -m lab daytrace --out day.jsonl [--peak-rate 0.07] [--hours 6] [--seed 0]
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# (hour of the day, share of the peak rate); linear in between.
DAY_SHAPE = [(0, 0.15), (6, 0.15), (9, 1.0), (12, 1.0), (12.5, 0.7), (13.5, 0.7), (14, 0.9),
             (17, 0.9), (21, 0.3), (24, 0.15)]
BURST = (15.0, 15.33, 1.0)         # 15:00-15:20: the peak rate added on top (a batch job, a launch)
PREFIX, INPUT, OUTPUT, SPREAD = 1000, 4000, 3000, 0.2
DAY_PEAK_RATE = 0.07     # requests/s at the peak: about 5 groups' worth at the objective
DAY_HOURS = 6.0          # the day's shape in 6 h of virtual time (its rates unchanged)


def rate_share(hour: float) -> float:
    hours, shares = zip(*DAY_SHAPE)
    share = float(np.interp(hour % 24, hours, shares))
    if BURST[0] <= hour % 24 < BURST[1]:
        share += BURST[2]
    return share


def day_trace(peak_rate: float, hours: float = 24.0, seed: int = 0) -> list[dict]:
    """Requests of one day compressed to `hours` (the rate shape is kept, time is scaled)."""
    rng = np.random.default_rng(seed)
    duration = hours * 3600.0
    top = peak_rate * (1.0 + BURST[2])
    t, out = 0.0, []
    while True:
        t += rng.exponential(1.0 / top)
        if t >= duration:
            return out
        if rng.random() * top > peak_rate * rate_share(24.0 * t / duration):
            continue
        lo, hi = 1.0 - SPREAD, 1.0 + SPREAD
        out.append({"prompt_tokens": PREFIX + int(INPUT * rng.uniform(lo, hi)),
                    "prefix_group": "system", "prefix_tokens": PREFIX,
                    "output_tokens": int(OUTPUT * rng.uniform(lo, hi)),
                    "arrival_time": round(t, 3)})


def write_trace(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))

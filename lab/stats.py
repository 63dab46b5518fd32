"""Statistics over seeds: the one place lab and bench experiments compute them.

Every figure "over seeds" is the numpy mean and the population standard deviation (ddof 0) of
one value per seed (or per trial), as the machine-readable summaries report them:
`{"mean", "std", "min", "max", "values"}`.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

import numpy as np

from loadtest.metrics import HEADLINE_KEYS, REPORT_KEYS, percent_change, summary_keys

# The keys of a lab run's summary reported over seeds (`lab run`'s summary.json, lab.replicas).
SUMMARY_KEYS = summary_keys(*REPORT_KEYS, "mean_itl_ms", "total_token_throughput", "failed")


def over_seeds(values: Iterable[float]) -> dict:
    """mean, std (ddof 0), min, max and the values themselves, as floats."""
    v = np.array(list(values), dtype=float)
    return {"mean": float(v.mean()), "std": float(v.std()), "min": float(v.min()),
            "max": float(v.max()), "values": v.tolist()}


def mean(values: Iterable[float]) -> float:
    """The mean over seeds (or trials), computed as `over_seeds` does."""
    return over_seeds(values)["mean"]


def aggregate(results: Mapping[str, Sequence[Mapping]], keys: Sequence[str]) -> dict[str, dict]:
    """policy -> key -> over_seeds, from policy -> one summary (a dict with `keys`) per seed."""
    return {policy: {key: over_seeds(r[key] for r in runs) for key in keys}
            for policy, runs in results.items()}


def versus(agg: Mapping[str, Mapping[str, dict]], baseline: str,
           keys: Sequence[str] = HEADLINE_KEYS) -> dict[str, dict]:
    """policy -> key -> change of the mean against the baseline policy, in % (and the ratio
    baseline / policy); {} when the baseline did not run."""
    if baseline not in agg:
        return {}
    out = {}
    for policy, stats in agg.items():
        if policy == baseline:
            continue
        out[policy] = {}
        for key in keys:
            base, mine = agg[baseline][key]["mean"], stats[key]["mean"]
            out[policy][key] = {"change_pct": percent_change(base, mine),
                                "baseline_over_policy": base / mine if mine else None}
    return out

"""Model time and wall time: a simulator at `speedup` S runs S model seconds per wall second.

Engine times, /metrics and the lab read in model time; the simulator's loop, the picker's timers and
the load test's clock run in wall time. Every conversion between the two goes through here.
"""


def to_model_seconds(wall_seconds: float, speedup: float) -> float:
    return wall_seconds * speedup


def to_wall_seconds(model_seconds: float, speedup: float) -> float:
    return model_seconds / speedup


def to_model_rate(per_wall_second: float, speedup: float) -> float:
    """A rate (tokens/s, requests/s) measured per wall second, per model second."""
    return per_wall_second / speedup

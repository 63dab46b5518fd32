"""The online output-length predictor: what the answers to requests like this one were lately.

For each family of features (the client alone, the prompt's template, the cap, the client with
its template, ...; FAMILIES) and each value seen, a histogram of the completion lengths observed,
in quarter-octave bins of log2(length) (a few % of resolution, from 1 token to 64k). Each
histogram forgets by count: a new answer weighs 1, the older ones together at most
`memory` - 1 (exponential forgetting), so a key follows its traffic as it changes; the keys of a
family are kept in LRU order up to `max_keys` (bounded memory).

A forecast blends the chosen family's histogram for the request's key with the pool-wide prior
(the same model's histogram over all its requests: `prior_weight` pseudo-answers), so a key seen
once or twice leans on the prior and a key without history is the prior. The chosen family is
the one whose forecasts have been best lately: every outcome scores each family's median
forecast for that request, before learning from it, by its absolute error in log2 (an EWMA per
model). A feature that predicts nothing for this deployment's traffic thus loses to the prior,
and one that does (a client whose answers are long, a template, a cap) wins within tens of
requests.

Forecasts never exceed the request's own cap (`max_tokens`): the engine stops there.

Hand-written: the sketches are a few dozen bins each, updated once per finished request and read
once per decision; a library sketch (t-digest, DDSketch) would add a dependency and a per-call
cost for the same thing, and none of them forgets by count.
"""
from __future__ import annotations

import math
from bisect import bisect_right
from collections import OrderedDict
from dataclasses import dataclass

from picker.lengths.features import Features

BINS_PER_OCTAVE = 4
MAX_BIN = 16 * BINS_PER_OCTAVE - 1             # 64k tokens
# (name, the Features fields of its key). The first is the prior: the model alone.
FAMILIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("prior", ()),
    ("client", ("client",)),
    ("template", ("template",)),
    ("context", ("context",)),
    ("cap", ("cap",)),
    ("prompt", ("prompt",)),
    ("prompt-octave", ("prompt_octave",)),
    ("mode", ("mode",)),
    ("client+template", ("client", "template")),
    ("client+mode", ("client", "mode")),
    ("template+prompt", ("template", "prompt")),
)
# Every outcome scores the families' forecasts for its model's first SCORE_ALL answers, then
# every SCORE_EVERY-th (scoring a dozen families costs more than the rest of the learning; the
# errors' EWMA needs a sample, not every answer).
SCORE_ALL, SCORE_EVERY = 256, 4
# Probabilities of the quantiles a forecast carries.
LEVELS = tuple((i + 0.5) / 16 for i in range(16))


def length_bin(n: int) -> int:
    return 0 if n <= 1 else min(MAX_BIN, int(BINS_PER_OCTAVE * math.log2(n)))


def bin_low(b: int) -> float:
    return 2.0 ** (b / BINS_PER_OCTAVE)


class DecayedHistogram:
    """Counts per bin, forgetting by count: after each add the older weights are scaled by
    `keep` (stored unscaled, with a growing unit, so an add costs O(1))."""

    __slots__ = ("counts", "unit", "total")

    def __init__(self):
        self.counts: dict[int, float] = {}
        self.unit = 1.0        # the weight of the newest answer, in stored units
        self.total = 0.0       # stored units

    def add(self, b: int, keep: float) -> None:
        self.unit /= keep
        self.counts[b] = self.counts.get(b, 0.0) + self.unit
        self.total += self.unit
        if self.unit > 1e100:  # renormalise before the floats overflow
            scale = 1.0 / self.unit
            self.counts = {k: v * scale for k, v in self.counts.items() if v * scale > 1e-9}
            self.total *= scale
            self.unit = 1.0

    @property
    def weight(self) -> float:
        """The effective number of answers held (the newest counts 1)."""
        return self.total / self.unit


@dataclass(frozen=True, slots=True)
class Forecast:
    """A predicted answer length: quantiles at LEVELS (tokens, ascending), and where from."""
    quantiles: tuple[float, ...]
    family: str
    support: float          # effective answers of the key behind it (0: the prior alone)

    @property
    def median(self) -> float:
        q = self.quantiles
        return 0.5 * (q[7] + q[8])

    @property
    def high(self) -> float:
        """The 0.9 quantile (interpolated between the levels around it)."""
        q = self.quantiles
        return q[13] + (q[14] - q[13]) * (0.9 - LEVELS[13]) / (LEVELS[14] - LEVELS[13])

    @property
    def mean(self) -> float:
        return sum(self.quantiles) / len(self.quantiles)

    def survival(self, produced: float) -> float:
        """How likely an answer that has reached `produced` tokens goes on (the share of the
        quantiles above it, half a level at least)."""
        q = self.quantiles
        return max(0.5, len(q) - bisect_right(q, produced)) / len(q)

    def residual(self, produced: float) -> float:
        """Tokens still to come once `produced` have been: the median excess of the quantiles
        above it (the median, not the mean: a heavy tail's mean residual is set by its rare
        extremes, and every projection would wait for them); past all of them, a quarter of
        what was produced (a long tail's residual life grows with age)."""
        q = self.quantiles                     # ascending
        i = bisect_right(q, produced)
        n = len(q) - i
        if not n:
            return max(1.0, 0.25 * produced)
        mid = i + n // 2
        return (q[mid] if n % 2 else 0.5 * (q[mid - 1] + q[mid])) - produced


@dataclass(frozen=True, slots=True)
class PredictorSettings:
    memory: float = 64.0          # answers a key remembers (older ones fade)
    prior_memory: float = 512.0   # the same for the pool-wide prior
    prior_weight: float = 1.0     # pseudo-answers of the prior in every forecast
    max_keys: int = 2048          # per family and model, LRU
    loss_alpha: float = 0.03      # EWMA weight of a family's recent forecast errors
    default_length: float = 256.0  # the forecast before the first answer of a model

    def __post_init__(self):
        if self.memory <= 1 or self.prior_memory <= 1 or self.prior_weight < 0 \
                or self.max_keys < 1 or not 0 < self.loss_alpha <= 1 or self.default_length < 1:
            raise ValueError("predictor settings: memory > 1, prior_memory > 1, prior_weight >= 0, "
                             "max_keys >= 1, 0 < loss_alpha <= 1, default_length >= 1")


class _ModelTables:
    """One model's histograms: the prior, and per family its keys in LRU order."""

    __slots__ = ("prior", "families", "loss", "answers")

    def __init__(self):
        self.prior = DecayedHistogram()
        self.families: list[OrderedDict[tuple, DecayedHistogram]] = [
            OrderedDict() for _ in FAMILIES]
        self.loss = [math.inf] * len(FAMILIES)   # inf: not scored yet
        self.answers = 0


def _key(features: Features, fields: tuple[str, ...]) -> tuple:
    return tuple(getattr(features, f) for f in fields)


class LengthPredictor:
    def __init__(self, settings: PredictorSettings | None = None):
        self.settings = settings or PredictorSettings()
        s = self.settings
        self._keep = 1.0 - 1.0 / s.memory
        self._prior_keep = 1.0 - 1.0 / s.prior_memory
        self.models: dict[str, _ModelTables] = {}
        self.learned = 0

    # ---- learning ------------------------------------------------------------------------
    def learn(self, features: Features, completion_tokens: int) -> None:
        """One finished request's answer length."""
        if completion_tokens < 0:
            return
        tables = self.models.get(features.model)
        if tables is None:
            tables = self.models[features.model] = _ModelTables()
        if tables.answers < SCORE_ALL or tables.answers % SCORE_EVERY == 0:
            self._score(tables, features, completion_tokens)
        b = length_bin(completion_tokens)
        tables.prior.add(b, self._prior_keep)
        for i, (_, fields) in enumerate(FAMILIES[1:], start=1):
            table = tables.families[i]
            key = _key(features, fields)
            hist = table.get(key)
            if hist is None:
                hist = table[key] = DecayedHistogram()
                if len(table) > self.settings.max_keys:
                    table.popitem(last=False)
            else:
                table.move_to_end(key)
            hist.add(b, self._keep)
        tables.answers += 1
        self.learned += 1

    def _score(self, tables: _ModelTables, features: Features, actual: int) -> None:
        """Each family's forecast for this request, scored before learning from it."""
        if tables.answers == 0:
            return
        target = math.log2(max(1, actual))
        alpha = self.settings.loss_alpha
        for i in range(len(FAMILIES)):
            median = self._quantiles(tables, i, features, (0.5,))[0]
            err = abs(math.log2(max(1.0, median)) - target)
            old = tables.loss[i]
            tables.loss[i] = err if old == math.inf else old + alpha * (err - old)

    # ---- forecasting ---------------------------------------------------------------------
    def forecast(self, features: Features) -> Forecast:
        tables = self.models.get(features.model)
        if tables is None or tables.answers == 0:
            d = float(self.settings.default_length)
            if features.cap_tokens is not None:
                d = min(d, float(max(1, features.cap_tokens)))
            return Forecast((d,) * len(LEVELS), "default", 0.0)
        best = self.best_family(tables)
        hist = self._hist(tables, best, features)
        q = self._quantiles(tables, best, features, LEVELS)
        return Forecast(tuple(q), FAMILIES[best][0], hist.weight if hist is not None else 0.0)

    def prior(self, model: str) -> Forecast:
        """The pool-wide forecast for a model (no features)."""
        tables = self.models.get(model)
        if tables is None or tables.prior.total <= 0:
            return Forecast((float(self.settings.default_length),) * len(LEVELS), "default", 0.0)
        w = 1.0 / tables.prior.total
        q = _levels({b: c * w for b, c in tables.prior.counts.items()}, LEVELS)
        return Forecast(tuple(q), "prior", tables.prior.weight)

    def best_family(self, tables: _ModelTables) -> int:
        loss = tables.loss
        best = 0
        for i in range(1, len(loss)):
            if loss[i] < loss[best] - 1e-9:
                best = i
        return best

    def _hist(self, tables: _ModelTables, family: int, features: Features) -> DecayedHistogram | None:
        if family == 0:
            return None
        return tables.families[family].get(_key(features, FAMILIES[family][1]))

    def _quantiles(self, tables: _ModelTables, family: int, features: Features,
                   levels: tuple[float, ...]) -> list[float]:
        """Quantiles of (the key's histogram + prior_weight x the prior), capped."""
        prior = tables.prior
        hist = self._hist(tables, family, features)
        mix: dict[int, float] = {}
        if prior.total > 0:
            w = self.settings.prior_weight / prior.total
            if hist is None:
                w = 1.0 / prior.total
            for b, c in prior.counts.items():
                mix[b] = c * w
        if hist is not None and hist.total > 0:
            w = 1.0 / hist.unit
            for b, c in hist.counts.items():
                mix[b] = mix.get(b, 0.0) + c * w
        out = _levels(mix, levels)
        cap = features.cap_tokens
        if cap is not None:
            out = [min(q, float(max(1, cap))) for q in out]
        return out

    def family_losses(self, model: str) -> dict[str, float]:
        """Each family's recent mean |log2 error| for a model (inf: not scored yet)."""
        tables = self.models.get(model)
        if tables is None:
            return {}
        return {name: loss for (name, _), loss in zip(FAMILIES, tables.loss)}


def _levels(mix: dict[int, float], levels: tuple[float, ...]) -> list[float]:
    """The quantiles of a binned distribution, interpolated in log2 within a bin."""
    total = sum(mix.values())
    if total <= 0:
        return [1.0] * len(levels)
    out = []
    acc, i = 0.0, 0
    bins = sorted(mix.items())
    for level in levels:
        want = level * total
        while i < len(bins) - 1 and acc + bins[i][1] < want:
            acc += bins[i][1]
            i += 1
        b, c = bins[i]
        frac = min(1.0, max(0.0, (want - acc) / c)) if c > 0 else 0.5
        out.append(2.0 ** ((b + frac) / BINS_PER_OCTAVE))
    return out

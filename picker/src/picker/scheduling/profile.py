"""Scheduling profiles: YAML that names filters, weighted scorers, a picker and thresholds.

    name: upstream-default
    filters: [{type: saturation, params: {...}}]      # optional
    scorers: [{type: queue, weight: 2, params: {...}}, ...]
    picker: {type: max-score}
    saturation: {queueDepthThreshold: 5, kvCacheUtilThreshold: 0.8}
    prefix: {blockSizeTokens: 16, maxPrefixBlocks: 256, lruCapacityPerServer: 31250}
    prefilter: {above: 32, sample: 8, least: 4, owners: 8}   # optional, see prefilter.py
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from picker import defaults
from picker.scheduling import registry
from picker.scheduling.context import SchedulingContext
from picker.scheduling.filters import Filter
from picker.scheduling.pickers import Picker
from picker.scheduling.prefilter import PrefilterSettings
from picker.scheduling.rendezvous import OFF, ColdPrefixSettings, pick_cold
from picker.scheduling.saturation import SaturationThresholds
from picker.scheduling.scorers import Scorer
from picker.signals.state import EndpointState


@dataclass(slots=True)
class WeightedScorer:
    name: str
    weight: float
    fn: Scorer


@dataclass(slots=True)
class Profile:
    name: str
    filters: list[tuple[str, Filter]]
    scorers: list[WeightedScorer]
    picker: Picker
    saturation: SaturationThresholds = field(default_factory=SaturationThresholds)
    block_size_tokens: int = defaults.PREFIX_BLOCK_SIZE_TOKENS
    max_prefix_blocks: int = defaults.PREFIX_MAX_BLOCKS
    lru_capacity_per_server: int = defaults.PREFIX_LRU_CAPACITY_PER_SERVER
    needs_prefix: bool = False
    prefilter: PrefilterSettings = field(default_factory=PrefilterSettings)
    cold_prefix: ColdPrefixSettings = OFF
    source: dict[str, Any] = field(default_factory=dict)


def schedule(profile: Profile, ctx: SchedulingContext, candidates: list[EndpointState],
             rng: random.Random) -> EndpointState:
    """Filters, then the weighted sum of clamped scores, then the pick. Candidates must be non-empty."""
    eps = candidates
    for _, flt in profile.filters:
        eps = flt(ctx, eps)
    if len(eps) == 1:
        return eps[0]
    totals = [0.0] * len(eps)
    for ws in profile.scorers:
        w = ws.weight
        totals = [t + w * (0.0 if s < 0.0 else 1.0 if s > 1.0 else s)
                  for t, s in zip(totals, ws.fn(ctx, eps))]
    if profile.cold_prefix.enabled and ctx.hashes:
        agreed = pick_cold(profile.cold_prefix, ctx, totals, eps)
        if agreed is not None:
            return agreed
    return profile.picker(totals, eps, rng)


def _entry(item: Any, where: str) -> tuple[str, dict[str, Any]]:
    if isinstance(item, str):
        return item, {}
    if not isinstance(item, dict) or not isinstance(item.get("type"), str):
        raise ValueError(f"{where}: each entry needs a string 'type'")
    params = item.get("params") or {}
    if not isinstance(params, dict):
        raise ValueError(f"{where}: 'params' must be a mapping")
    return item["type"], params


def profile_from_dict(doc: dict[str, Any], source: str = "<dict>") -> Profile:
    if not isinstance(doc, dict):
        raise ValueError(f"{source}: a profile must be a mapping")
    try:
        filters = []
        needs_prefix = False
        for i, item in enumerate(doc.get("filters") or []):
            name, params = _entry(item, f"{source}: filters[{i}]")
            filters.append((name, registry.build("filter", registry.FILTERS, name, params)))
            needs_prefix |= registry.canonical(name) in registry.NEEDS_PREFIX
        scorers = []
        for i, item in enumerate(doc.get("scorers") or []):
            name, params = _entry(item, f"{source}: scorers[{i}]")
            weight = float(item.get("weight", 1.0)) if isinstance(item, dict) else 1.0
            scorers.append(WeightedScorer(name, weight,
                                          registry.build("scorer", registry.SCORERS, name, params)))
            needs_prefix |= registry.canonical(name) in registry.NEEDS_PREFIX
        pname, pparams = _entry(doc.get("picker") or "max-score", f"{source}: picker")
        picker = registry.build("picker", registry.PICKERS, pname, pparams)
        sat = doc.get("saturation") or {}
        prefix = doc.get("prefix") or {}
        pf = doc.get("prefilter") or {}
        unknown = set(pf) - {"above", "sample", "least", "owners"}
        if unknown:
            raise ValueError(f"prefilter: unknown keys {sorted(unknown)}")
        prefilter = PrefilterSettings(**{k: int(v) for k, v in pf.items()})
        if prefilter.above < 1 or min(prefilter.sample, prefilter.least, prefilter.owners) < 0:
            raise ValueError("prefilter: 'above' must be >= 1 and the counts >= 0")
        cold = doc.get("coldPrefix")
        cold_prefix = OFF if cold is None else _cold_prefix(cold)
        return Profile(
            name=str(doc.get("name", source)),
            filters=filters,
            scorers=scorers,
            picker=picker,
            saturation=SaturationThresholds(
                float(sat.get("queueDepthThreshold", defaults.SATURATION_QUEUE_DEPTH)),
                float(sat.get("kvCacheUtilThreshold", defaults.SATURATION_KV_CACHE_UTIL))),
            block_size_tokens=int(prefix.get("blockSizeTokens", defaults.PREFIX_BLOCK_SIZE_TOKENS)),
            max_prefix_blocks=int(prefix.get("maxPrefixBlocks", defaults.PREFIX_MAX_BLOCKS)),
            lru_capacity_per_server=int(prefix.get("lruCapacityPerServer", defaults.PREFIX_LRU_CAPACITY_PER_SERVER)),
            needs_prefix=needs_prefix,
            prefilter=prefilter,
            cold_prefix=cold_prefix,
            source=doc,
        )
    except ValueError as exc:
        msg = str(exc)
        raise ValueError(msg if msg.startswith(source) else f"{source}: {msg}") from None


def _cold_prefix(doc: Any) -> ColdPrefixSettings:
    if not isinstance(doc, dict):
        raise ValueError("coldPrefix: must be a mapping {tolerance, keyBlocks}")
    unknown = set(doc) - {"tolerance", "keyBlocks"}
    if unknown:
        raise ValueError(f"coldPrefix: unknown keys {sorted(unknown)}")
    settings = ColdPrefixSettings(float(doc.get("tolerance", 0.0)), int(doc.get("keyBlocks", 4)))
    if settings.tolerance < 0 or settings.key_blocks < 1:
        raise ValueError("coldPrefix: 'tolerance' must be >= 0 and 'keyBlocks' >= 1")
    return settings


def builtin_profiles() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("picker.profiles").iterdir()
                  if p.name.endswith(".yaml"))


def load_profile(name_or_path: str) -> Profile:
    """A built-in profile by name (`default`, `upstream-default`, ...) or a YAML file path."""
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        text, source = path.read_text(), str(path)
    else:
        res = resources.files("picker.profiles") / f"{name_or_path}.yaml"
        if not res.is_file():
            raise ValueError(f"unknown profile {name_or_path!r}; built in: "
                             f"{', '.join(builtin_profiles())}, or give a YAML file path")
        text, source = res.read_text(), f"profile {name_or_path}"
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(f"{source}: invalid YAML: {exc}") from None
    return profile_from_dict(doc, source)

"""Cold prefixes placed by rendezvous hashing, so independent picker replicas agree.

A picker replica learns that an endpoint holds a prefix from its own decisions (the approximate
index, precise in-flight entries) and from the engines' KV-cache events, which come only once
the first prefill of that prefix is done. Until then every other replica sees the prefix as
cold and sends its share of the burst wherever its own view of the load is lightest: one
tenant's burst is split over as many endpoints as there are replicas, and each of them prefills
the same system prompt.

Rendezvous (highest-random-weight) hashing settles this without any exchange: when the request
would go to an endpoint holding none of its prompt, the picker chooses, among the endpoints
scoring within `tolerance` of the best that hold none of it, the one with the highest weight
xxh64(address, key), the key naming the prompt's first `key_blocks` blocks. Every replica
computes the same order for the same prefix, so every replica sends a new tenant to the same
endpoint, and when that one is too busy, spills to the same second one. Warm requests (the
best endpoint holds some of the prompt) are untouched.

The tolerance is in total-score units (the profile's weighted sum): it bounds how much worse,
by the replica's own view of the load, the agreed endpoint may look than the best.
"""
from __future__ import annotations

from dataclasses import dataclass

import xxhash

from picker.scheduling.context import SchedulingContext
from picker.signals.state import EndpointState


@dataclass(frozen=True, slots=True)
class ColdPrefixSettings:
    tolerance: float = 0.0      # total-score units below the best; < 0: off
    key_blocks: int = 4         # the key names the prompt's first key_blocks prefix blocks

    @property
    def enabled(self) -> bool:
        return self.tolerance >= 0.0


OFF = ColdPrefixSettings(tolerance=-1.0)


def prefix_key(hashes: list[int], key_blocks: int) -> int | None:
    """The block hash naming the prompt's first `key_blocks` blocks (hashes are chained), or
    None for a shorter prompt: its prefix costs little to prefill twice."""
    if len(hashes) < key_blocks:
        return None
    return hashes[key_blocks - 1]


xxh64 = xxhash.xxh64_intdigest


def weight(key: int, address: str) -> int:
    """The endpoint's rendezvous weight for the prefix `key` (the same in every process)."""
    return xxh64(address.encode(), key)


def pick_cold(settings: ColdPrefixSettings, ctx: SchedulingContext, totals: list[float],
              eps: list[EndpointState]) -> EndpointState | None:
    """The endpoint of highest weight for the prompt's prefix among those within `tolerance` of
    the best total that hold none of the prompt, for a request whose best-scoring endpoints
    hold none of it; None when the rule does not apply (one of the best holds some of the
    prompt, or the prompt is shorter than `key_blocks` blocks)."""
    key = prefix_key(ctx.hashes, settings.key_blocks)
    if key is None:
        return None
    held = ctx.owner_tokens()
    best = max(totals)
    if held and any(t >= best - 1e-9 and e.address in held for t, e in zip(totals, eps)):
        return None
    floor = best - settings.tolerance - 1e-9
    chosen, top = None, -1
    for t, e in zip(totals, eps):
        if t >= floor and e.address not in held:
            w = xxh64(e.address.encode(), key)
            if w > top:
                chosen, top = e, w
    return chosen

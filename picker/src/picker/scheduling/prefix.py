"""Approximate prefix-cache index, like the upstream endpoint picker's approximate prefix scorer.

The prompt is cut into blocks of block_size_tokens * 4 characters; block i's hash is xxh64 of its
bytes seeded with block i-1's hash (block 0 is seeded with the model name), so a hash names the
whole prefix up to that block. Each endpoint remembers, LRU-bounded, the hashes of prompts the
picker sent to it; an endpoint's match is the number of leading blocks it holds.
"""
from __future__ import annotations

import itertools

import xxhash

from picker.openai import CHARS_PER_TOKEN


def block_hashes(model: str, prompt: str, block_size_tokens: int, max_blocks: int) -> list[int]:
    block_chars = block_size_tokens * CHARS_PER_TOKEN
    n = min(len(prompt) // block_chars, max_blocks)
    if n == 0:
        return []
    data = prompt[: n * block_chars].encode("utf-8", "surrogatepass")
    if len(data) != n * block_chars:  # non-ASCII text: cut on characters, then encode each block
        chunks = [prompt[i * block_chars:(i + 1) * block_chars].encode("utf-8", "surrogatepass")
                  for i in range(n)]
    else:
        chunks = [data[i * block_chars:(i + 1) * block_chars] for i in range(n)]
    h = xxhash.xxh64_intdigest(model.encode("utf-8", "surrogatepass"))
    intdigest = xxhash.xxh64_intdigest
    out = []
    for chunk in chunks:
        h = intdigest(chunk, h)
        out.append(h)
    return out


_ABSENT = object()


class PrefixIndex:
    """hash -> endpoints holding it, plus a per-endpoint LRU of hashes for eviction.

    The LRU is a plain dict used in insertion order (re-inserting moves a key to the end), which
    is cheaper than OrderedDict; eviction runs in batches once an endpoint is 1/8 over capacity.
    """

    def __init__(self, capacity_per_endpoint: int):
        self.capacity = capacity_per_endpoint
        self._holders: dict[int, set[str]] = {}
        self._lru: dict[str, dict[int, None]] = {}

    def match(self, hashes: list[int]) -> dict[str, int]:
        """Leading blocks matched per endpoint (endpoints with no match are absent)."""
        matched: dict[str, int] = {}
        holders_of = self._holders.get
        active: set[str] | None = None
        for i, h in enumerate(hashes):
            holders = holders_of(h)
            if not holders:
                break
            if active is None:
                active = set(holders)
            elif not holders >= active:
                active &= holders
                if not active:
                    break
            for addr in active:
                matched[addr] = i + 1
        return matched

    def add(self, address: str, hashes: list[int], capacity: int | None = None) -> None:
        lru = self._lru.get(address)
        if lru is None:
            lru = self._lru[address] = {}
        holders = self._holders
        pop = lru.pop
        for h in hashes:
            if pop(h, _ABSENT) is _ABSENT:  # new to this endpoint
                s = holders.get(h)
                if s is None:
                    holders[h] = {address}
                else:
                    s.add(address)
            lru[h] = None
        cap = capacity or self.capacity
        if len(lru) > cap + (cap >> 3):
            self._evict(address, lru, len(lru) - cap)

    def _evict(self, address: str, lru: dict[int, None], count: int) -> None:
        holders = self._holders
        old = list(itertools.islice(lru, count))
        for h in old:
            del lru[h]
            s = holders.get(h)
            if s is not None:
                s.discard(address)
                if not s:
                    del holders[h]

    def remove_endpoint(self, address: str) -> None:
        lru = self._lru.pop(address, None)
        if lru:
            self._lru[address] = lru
            self._evict(address, lru, len(lru))
            del self._lru[address]

    def size(self, address: str | None = None) -> int:
        if address is not None:
            return len(self._lru.get(address, ()))
        return sum(len(v) for v in self._lru.values())

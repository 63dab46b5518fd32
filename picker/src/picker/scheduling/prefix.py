"""Approximate prefix-cache index, like the upstream endpoint picker's approximate prefix scorer.

The prompt is cut into blocks of block_size_tokens * 4 characters; block i's hash is xxh64 of its
bytes seeded with block i-1's hash (block 0 is seeded with the model name), so a hash names the
whole prefix up to that block. Each endpoint remembers, LRU-bounded, the hashes of prompts the
picker sent to it; an endpoint's match is the number of leading blocks it holds.
"""
from __future__ import annotations

from collections import OrderedDict

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


class PrefixIndex:
    """hash -> endpoints holding it, plus a per-endpoint LRU of hashes for eviction."""

    def __init__(self, capacity_per_endpoint: int):
        self.capacity = capacity_per_endpoint
        self._holders: dict[int, set[str]] = {}
        self._lru: dict[str, OrderedDict[int, None]] = {}

    def match(self, hashes: list[int], addresses: set[str] | None = None) -> dict[str, int]:
        """Leading blocks matched per endpoint (endpoints with no match are absent)."""
        matched: dict[str, int] = {}
        active: set[str] | None = None
        for i, h in enumerate(hashes):
            holders = self._holders.get(h)
            if not holders:
                break
            active = holders.copy() if active is None else active & holders
            if addresses is not None:
                active &= addresses
            if not active:
                break
            for addr in active:
                matched[addr] = i + 1
        return matched

    def add(self, address: str, hashes: list[int], capacity: int | None = None) -> None:
        lru = self._lru.get(address)
        if lru is None:
            lru = self._lru[address] = OrderedDict()
        cap = capacity or self.capacity
        holders = self._holders
        move = lru.move_to_end
        for h in hashes:
            if h in lru:
                move(h)
            else:
                lru[h] = None
                s = holders.get(h)
                if s is None:
                    holders[h] = {address}
                else:
                    s.add(address)
        excess = len(lru) - cap
        if excess > 0:  # evict the least recently used (inlined: this loop is the hot path)
            pop = lru.popitem
            for _ in range(excess):
                old, _v = pop(last=False)
                s = holders.get(old)
                if s is not None:
                    s.discard(address)
                    if not s:
                        del holders[old]

    def remove_endpoint(self, address: str) -> None:
        for h in self._lru.pop(address, ()):
            self._discard(h, address)

    def _discard(self, h: int, address: str) -> None:
        s = self._holders.get(h)
        if s is not None:
            s.discard(address)
            if not s:
                del self._holders[h]

    def size(self, address: str | None = None) -> int:
        if address is not None:
            return len(self._lru.get(address, ()))
        return sum(len(v) for v in self._lru.values())

"""The precise prefix index: what each endpoint's engine reported holding in its KV cache.

Fed with deltas from signals/kvstate.py (own block hashes added and removed per endpoint, and
whether the endpoint's events are in sync). A request's own block chain (its token ids cut
into the endpoint's block size, signals.kvstate.chain_hashes) matches an endpoint up to the
first block it does not hold. Endpoints not in sync are absent: the caller falls back to the
approximate index for them.

In-flight entries: a decision routed a request to an endpoint in sync (`add_inflight`); its
blocks count as held there (`match`, `holds_any`) until the engine's events store them (then
they are ordinary entries), the entry expires (`expire`), or the endpoint leaves sync. Without
them a burst of one tenant spreads over the endpoints before the first prefill's events arrive.
`holds` (the tokenizer check) and `size` see confirmed blocks only. Bounded: at most
KV_INFLIGHT_MAX_BLOCKS entries, the oldest decisions dropped first.

Memory: one dict entry per (block, holder), the holder stored as the address string itself
while a block has one holder (the usual case with prefix-aware routing), a set beyond.
"""
from __future__ import annotations

from collections import deque
from typing import Iterable

from picker import defaults


class PreciseIndex:
    def __init__(self):
        self._holders: dict[int, str | set[str]] = {}
        self.counts: dict[str, int] = {}            # blocks held, per endpoint in sync
        self.block_size: dict[str, int] = {}        # per endpoint in sync
        self.reason: dict[str, str] = {}            # per endpoint followed: "" = in sync
        self._sizes: list[int] | None = None         # block sizes of the in-sync endpoints
        self._inflight: dict[int, dict[str, float]] = {}  # hash -> {endpoint: expiry}
        self._decisions: deque = deque()             # (expiry, endpoint, hashes), oldest first
        self._inflight_blocks = 0                    # sum of len(hashes) in _decisions
        self.inflight_max = defaults.KV_INFLIGHT_MAX_BLOCKS

    def in_sync(self, address: str) -> bool:
        return self.reason.get(address) == ""

    def apply(self, deltas: Iterable[tuple]) -> None:
        """Deltas (address, in_sync, reason, block_size, added, removed) from the tracker."""
        for address, in_sync, reason, block_size, added, removed in deltas:
            reason = "" if in_sync else reason
            if reason and self.reason.get(address) == "":
                self._drop_inflight(address)
            if self.reason.get(address) != reason or (
                    block_size and self.block_size.get(address) != block_size):
                self._sizes = None
            self.reason[address] = reason
            if block_size:
                self.block_size[address] = block_size
            if address not in self.counts:
                self.counts[address] = 0
            for h in added:
                self._add(h, address)
            for h in removed:
                self._remove(h, address)
            if not in_sync and not self.counts[address]:
                del self.counts[address]

    def forget(self, address: str) -> None:
        """The endpoint left the pool: no longer matched. Its blocks go with the tracker's last
        delta for it (removing every block), so no scan of the index is needed here."""
        self.reason.pop(address, None)
        self._sizes = None
        self._drop_inflight(address)

    def sizes(self) -> list[int]:
        """The block sizes of the endpoints in sync (usually one)."""
        if self._sizes is None:
            self._sizes = sorted({bs for a, bs in self.block_size.items()
                                  if self.reason.get(a) == ""})
        return self._sizes

    def holds_any(self, h: int) -> bool:
        """Held by some endpoint in sync, or in flight to one."""
        return h in self._holders or h in self._inflight

    def holds(self, h: int, address: str) -> bool:
        held = self._holders.get(h)
        return held == address if isinstance(held, str) else held is not None and address in held

    def match(self, hashes: list[int], addresses: Iterable[str] | None = None) -> dict[str, int]:
        """Leading blocks of `hashes` held, per endpoint (absent: none), among `addresses` if
        given. All endpoints compared must share the chain's block size (see blocks_by_size)."""
        matched: dict[str, int] = {}
        holders_of = self._holders.get
        active: set[str] | None = None if addresses is None else set(addresses)
        inflight_of = self._inflight.get
        for i, h in enumerate(hashes):
            held = holders_of(h)
            flying = inflight_of(h)
            if flying:
                held = {held, *flying} if isinstance(held, str) else (
                    set(flying) if held is None else held | flying.keys())
            if held is None:
                break
            if isinstance(held, str):
                if active is not None and held not in active:
                    break
                active = {held}
            elif active is None:
                active = set(held)
            else:
                active &= held
            if not active:
                break
            for a in active:
                matched[a] = i + 1
        return matched

    def size(self, address: str | None = None) -> int:
        if address is not None:
            return self.counts.get(address, 0)
        return sum(self.counts.values())

    # ---- in-flight entries ---------------------------------------------------------------------
    def add_inflight(self, address: str, hashes: list[int], expiry: float) -> None:
        """The request with this block chain was routed to `address` (in sync): its blocks count
        as held there until `expiry` or until the engine's events store them."""
        if not hashes or not self.in_sync(address):
            return
        fresh = [h for h in hashes if not self.holds(h, address)]
        for h in fresh:
            self._inflight.setdefault(h, {})[address] = expiry
        self._decisions.append((expiry, address, fresh))
        self._inflight_blocks += len(fresh)
        while self._inflight_blocks > self.inflight_max and self._decisions:
            self._retire(*self._decisions.popleft())

    def expire(self, now: float) -> None:
        """Drop the entries whose time is up (decisions come in time order, one TTL)."""
        decisions = self._decisions
        while decisions and decisions[0][0] <= now:
            self._retire(*decisions.popleft())

    def inflight(self, address: str | None = None) -> int:
        """In-flight (block, endpoint) entries not yet confirmed nor expired."""
        return sum(1 for d in self._inflight.values() for a in d if address in (None, a))

    def _retire(self, expiry: float, address: str, hashes: list[int]) -> None:
        self._inflight_blocks -= len(hashes)
        inflight = self._inflight
        for h in hashes:
            d = inflight.get(h)
            if d is not None and d.get(address) == expiry:  # not refreshed by a later decision
                del d[address]
                if not d:
                    del inflight[h]

    def _drop_inflight(self, address: str) -> None:
        if not self._decisions:
            return
        for h in [h for h, d in self._inflight.items() if address in d]:
            d = self._inflight[h]
            del d[address]
            if not d:
                del self._inflight[h]

    # ---- internals ---------------------------------------------------------------------------
    def _add(self, h: int, address: str) -> None:
        flying = self._inflight.get(h)
        if flying and address in flying:   # confirmed: an ordinary entry from now on
            del flying[address]
            if not flying:
                del self._inflight[h]
        held = self._holders.get(h)
        if held is None:
            self._holders[h] = address
        elif isinstance(held, str):
            if held == address:
                return
            self._holders[h] = {held, address}
        elif address in held:
            return
        else:
            held.add(address)
        self.counts[address] += 1

    def _remove(self, h: int, address: str) -> None:
        held = self._holders.get(h)
        if held is None:
            return
        if isinstance(held, str):
            if held != address:
                return
            del self._holders[h]
        else:
            if address not in held:
                return
            held.discard(address)
            if len(held) == 1:
                self._holders[h] = next(iter(held))
        self.counts[address] -= 1

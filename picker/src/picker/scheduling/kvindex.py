"""The precise prefix index: what each endpoint's engine reported holding in its KV cache.

Fed with deltas from signals/kvstate.py (own block hashes added and removed per endpoint, and
whether the endpoint's events are in sync). A request's own block chain (its token ids cut
into the endpoint's block size, signals.kvstate.chain_hashes) matches an endpoint up to the
first block it does not hold. Endpoints not in sync are absent: the caller falls back to the
approximate index for them.

Memory: one dict entry per (block, holder), the holder stored as the address string itself
while a block has one holder (the usual case with prefix-aware routing), a set beyond.
"""
from __future__ import annotations

from typing import Iterable


class PreciseIndex:
    def __init__(self):
        self._holders: dict[int, str | set[str]] = {}
        self.counts: dict[str, int] = {}            # blocks held, per endpoint in sync
        self.block_size: dict[str, int] = {}        # per endpoint in sync
        self.reason: dict[str, str] = {}            # per endpoint followed: "" = in sync
        self._sizes: list[int] | None = None         # block sizes of the in-sync endpoints

    def in_sync(self, address: str) -> bool:
        return self.reason.get(address) == ""

    def apply(self, deltas: Iterable[tuple]) -> None:
        """Deltas (address, in_sync, reason, block_size, added, removed) from the tracker."""
        for address, in_sync, reason, block_size, added, removed in deltas:
            reason = "" if in_sync else reason
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

    def sizes(self) -> list[int]:
        """The block sizes of the endpoints in sync (usually one)."""
        if self._sizes is None:
            self._sizes = sorted({bs for a, bs in self.block_size.items()
                                  if self.reason.get(a) == ""})
        return self._sizes

    def holds_any(self, h: int) -> bool:
        return h in self._holders

    def holds(self, h: int, address: str) -> bool:
        held = self._holders.get(h)
        return held == address if isinstance(held, str) else held is not None and address in held

    def match(self, hashes: list[int], addresses: Iterable[str] | None = None) -> dict[str, int]:
        """Leading blocks of `hashes` held, per endpoint (absent: none), among `addresses` if
        given. All endpoints compared must share the chain's block size (see blocks_by_size)."""
        matched: dict[str, int] = {}
        holders_of = self._holders.get
        active: set[str] | None = None if addresses is None else set(addresses)
        for i, h in enumerate(hashes):
            held = holders_of(h)
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

    # ---- internals ---------------------------------------------------------------------------
    def _add(self, h: int, address: str) -> None:
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

"""Precise prefix routing for one Router: the request's own token ids matched against the blocks
the engines reported holding (their KV-cache events), per endpoint, with the approximate index
as the fallback for every endpoint whose events are not in sync.

    tokens = precise.tokens(path, parsed)        # the engine's token ids, or None (fall back)
    precise.match(ctx, tokens, target)           # ctx.precise / ctx.sync for the scorers
    precise.after_decision(ctx, address)         # checks that the tokenizer matches the engine

The index is fed either by the signals process (deltas, `apply`) or, in process, by a
KVTracker this object owns (`on_batch`: the routing lab and tests).

Tokenizer check: a request routed to an endpoint in sync makes the engine store (or hit) its
first block once it is prefilled. If KV_VERIFY_MISSES such first blocks in a row do not show up
in the index within KV_VERIFY_WINDOW, the picker's tokenizer does not produce the engine's token ids (another model, another
chat template): precise routing turns off for the whole replica (metric, one log line).
"""
from __future__ import annotations

import logging
from collections import deque
from typing import Iterable

from picker import defaults
from picker.openai import ParsedRequest
from picker.scheduling.context import SchedulingContext
from picker.scheduling.kvindex import PreciseIndex
from picker.signals.kvevents import EventBatch
from picker.signals.kvstate import KVTracker, chain_hashes, root_seed
from picker.tokenizer import ModelTokenizer, NotTokenizable

log = logging.getLogger("picker.precise")

# state values (metric picker_kv_tokenizer{state})
LOADED, MISSING, MISMATCH = "loaded", "missing", "mismatch"


class PrecisePrefix:
    def __init__(self, tokenizer: ModelTokenizer | None, max_tokens: int = 16384,
                 verify_window: float = defaults.KV_VERIFY_WINDOW,
                 verify_misses: int = defaults.KV_VERIFY_MISSES):
        self.tokenizer = tokenizer
        self.state = LOADED if tokenizer is not None else MISSING
        self.max_tokens = max_tokens                 # longest prefix matched, in tokens
        self.index = PreciseIndex()
        self.tracker: KVTracker | None = None        # in-process feeding only
        self.status: dict[str, tuple] = {}           # per endpoint, from the tracker
        self.untokenizable = 0                       # requests routed on the approximate index
        self.verify_window = verify_window
        self.verify_misses = verify_misses
        self._checks: deque = deque()                # (sent, address, first block's own hash)
        self._misses = 0
        self._first: dict[int, int] = {}             # block size -> first block, last match

    @property
    def active(self) -> bool:
        return self.state == LOADED

    # ---- feeding -----------------------------------------------------------------------------
    def apply(self, deltas: Iterable[tuple], status: dict[str, tuple] | None = None) -> None:
        """Index changes from the signals process (signals.kvstate.KVTracker.take_deltas)."""
        self.index.apply(deltas)
        if status is not None:
            self.status = status

    def on_batch(self, address: str, batch: EventBatch | list, now: float,
                 seq: int | None = None, wall_now: float | None = None) -> None:
        """Events of one endpoint, in process. A list of events is taken as one batch."""
        if not isinstance(batch, EventBatch):
            batch = EventBatch(now if wall_now is None else wall_now, list(batch))
        tracker = self._tracker()
        tracker.on_batch(address, batch, now, seq, wall_now)
        self._sync()

    def on_metrics(self, address: str, num_gpu_blocks: int | None, block_size: int | None,
                   computed_tokens: float | None, now: float) -> None:
        if self.tracker is not None and address in self.tracker.endpoints:
            self.tracker.set_capacity(address, num_gpu_blocks, block_size)
            self.tracker.on_activity(address, computed_tokens, now)
            self._sync()

    def forget(self, address: str) -> None:
        self.index.forget(address)
        if self.tracker is not None:
            self.tracker.remove(address)
            self._sync()

    def _tracker(self) -> KVTracker:
        if self.tracker is None:
            self.tracker = KVTracker()
        return self.tracker

    def _sync(self) -> None:
        self.index.apply(self.tracker.take_deltas())
        self.status = self.tracker.status()

    # ---- deciding ----------------------------------------------------------------------------
    def tokens(self, path: str, parsed: ParsedRequest) -> list[int] | None:
        """The request's token ids as the engine computes them; None: route approximately."""
        if self.state != LOADED:
            return None
        try:
            return self.tokenizer.request_tokens(path, parsed.obj)
        except NotTokenizable:
            self.untokenizable += 1
            return None

    def match(self, ctx: SchedulingContext, tokens: list[int], lora: str | None) -> None:
        """Cached tokens per in-sync endpoint into ctx (one chain per block size in use)."""
        index = self.index
        precise: dict[str, int] = {}
        first = self._first
        first.clear()
        seed = root_seed(lora)
        for bs in index.sizes():
            chain = chain_hashes(tokens, bs, seed, self.max_tokens // bs)
            if not chain:
                continue
            first[bs] = chain[0]
            sizes = index.block_size
            for addr, n in index.match(chain).items():
                if sizes.get(addr) == bs:
                    precise[addr] = n * bs
        ctx.precise = precise
        ctx.sync = index.reason

    def after_decision(self, ctx: SchedulingContext, address: str, now: float) -> None:
        """Remember this request's first block on its endpoint; settle the oldest checks: a
        first block found is a hit, one not found within the window a miss."""
        if ctx.precise is not None and ctx.sync.get(address) == "":
            bs = self.index.block_size.get(address)
            h = self._first.get(bs) if bs else None
            if h is not None:
                if len(self._checks) >= defaults.KV_VERIFY_PENDING:
                    self._checks.popleft()
                self._checks.append((now, address, h))
        checks, index = self._checks, self.index
        while checks:
            sent, addr, h = checks[0]
            if index.holds(h, addr):
                self._misses = 0
            elif not index.in_sync(addr):
                pass                     # no verdict from an endpoint out of sync
            elif now - sent < self.verify_window:
                return                   # not yet: it may be waiting in the engine's queue
            else:
                self._misses += 1
                if self._misses >= self.verify_misses and self.state == LOADED:
                    self._mismatch()
                    return
            checks.popleft()

    def _mismatch(self) -> None:
        self.state = MISMATCH
        self._checks.clear()
        log.error("the tokenizer does not match the engines: the first blocks of %d requests in "
                  "a row never appeared in their KV events; precise prefix routing is off, the "
                  "approximate prefix index is used", self._misses)

"""Precise prefix routing for one Router: the request's own token ids matched against the blocks
the engines reported holding (their KV-cache events), per endpoint, with the approximate index
as the fallback for every endpoint whose events are not in sync.

    prep = precise.prepare(path, parsed, lora, now)  # tokenized and matched, or None (fall back)
    precise.apply_to(ctx, prep)                  # ctx.precise / ctx.sync for the scorers
                                                 # (cached share x ctx.prompt_tokens)
    precise.after_decision(prep, address, now)   # in-flight entries; the tokenizer check

The index is fed either by the signals process (deltas, `apply`) or, in process, by a
KVTracker this object owns (`on_batch`: the routing lab and tests).

Tokenizer check: a request routed to an endpoint in sync makes the engine store (or hit) its
first block once it is prefilled. If KV_VERIFY_MISSES such first blocks in a row do not show up
in the index within KV_VERIFY_WINDOW, the picker's tokenizer does not produce the engine's token ids (another model, another
chat template): precise routing turns off for the whole replica (metric, one log line).

In-flight entries: the chosen endpoint (in sync) is recorded as holding the request's whole
block chain for `inflight_ttl` seconds of the caller's clock (kvindex.PreciseIndex.add_inflight),
so the next requests of a burst match it before its engine's events arrive. They are local to
this object (one worker of the picker).
"""
from __future__ import annotations

import logging
from array import array
from collections import deque
from dataclasses import dataclass
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


@dataclass(slots=True)
class Prepared:
    """One request, ready for scoring: its prompt tokens (exact, or estimated past the last
    block any endpoint holds), cached tokens per in-sync endpoint that holds some of it, and
    its first block's own hash per block size (the tokenizer check)."""
    prompt_tokens: int
    cached: dict[str, int]
    first: dict[int, int]
    chains: dict[int, list[int]] | None = None   # own block hashes per block size, so far
    rest: tuple | None = None   # (windows left, tokens, seed): tokenization stopped early


class PrecisePrefix:
    def __init__(self, tokenizer: ModelTokenizer | None, max_tokens: int = 16384,
                 verify_window: float = defaults.KV_VERIFY_WINDOW,
                 verify_misses: int = defaults.KV_VERIFY_MISSES,
                 inflight_ttl: float = defaults.KV_INFLIGHT_TTL):
        self.tokenizer = tokenizer
        self.state = LOADED if tokenizer is not None else MISSING
        self.max_tokens = max_tokens                 # longest prefix matched, in tokens
        self.index = PreciseIndex()
        self.tracker: KVTracker | None = None        # in-process feeding only
        self._status: dict[str, tuple] = {}          # per endpoint, from the signals process
        self.untokenizable = 0                       # requests routed on the approximate index
        self.verify_window = verify_window
        self.verify_misses = verify_misses
        self._checks: deque = deque()                # (sent, address, first block's own hash)
        self._misses = 0
        self.inflight_ttl = inflight_ttl              # 0: no in-flight entries

    @property
    def active(self) -> bool:
        return self.state == LOADED

    # ---- feeding -----------------------------------------------------------------------------
    def apply(self, deltas: Iterable[tuple], status: dict[str, tuple] | None = None) -> None:
        """Index changes from the signals process (signals.kvstate.KVTracker.take_deltas)."""
        self.index.apply(deltas)
        if status is not None:
            self._status = status

    @property
    def status(self) -> dict[str, tuple]:
        """Per endpoint followed: (in sync, reason, blocks, counters; kvstate.STAT_FIELDS)."""
        return self.tracker.status() if self.tracker is not None else self._status

    def on_batch(self, address: str, batch: EventBatch | list, now: float,
                 seq: int | None = None, wall_now: float | None = None,
                 num_gpu_blocks: int | None = None, block_size: int | None = None) -> None:
        """Events of one endpoint, in process. A list of events is taken as one batch; the
        endpoint's last scraped cache config sizes it when it is new."""
        if not isinstance(batch, EventBatch):
            batch = EventBatch(now if wall_now is None else wall_now, list(batch))
        tracker = self._tracker()
        if address not in tracker.endpoints:
            tracker.add(address, now, replay=seq not in (None, 0))
            tracker.set_capacity(address, num_gpu_blocks, block_size)
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

    # ---- deciding ----------------------------------------------------------------------------
    def prepare(self, path: str, parsed: ParsedRequest, lora: str | None,
                now: float | None = None) -> Prepared | None:
        """Tokenize the request as the engine will and match it against the in-sync endpoints'
        blocks. None: route approximately (precise off, nothing in sync, not tokenizable).

        Tokenization stops at the first block no in-sync endpoint holds (nothing further can
        match); the rest of the prompt's token count is then estimated at the tokens per
        character seen so far. Windows of a prefix shared by many prompts are cached."""
        index = self.index
        if now is not None:
            index.expire(now)
        sizes = index.sizes()
        if self.state != LOADED or not sizes:
            return None
        try:
            text, special, ids = self.tokenizer.request_text(path, parsed.obj)
        except NotTokenizable:
            self.untokenizable += 1
            return None
        seed = root_seed(lora)
        chains: dict[int, list[int]] = {bs: [] for bs in sizes}
        tokens = array("I")
        limit = self.max_tokens
        pieces = iter([(ids, None)] if text is None else self.tokenizer.windows(text, special))
        consumed = before = 0
        for piece, consumed in pieces:
            tokens.extend(piece)
            if not self._extend(chains, tokens, seed, limit) or len(tokens) >= limit:
                break
            before = consumed
        # what after_decision needs to finish the chosen size's chain (some lag behind)
        rest = (pieces if len(tokens) < limit else (), tokens, seed)
        if text is None or consumed >= len(text):
            prompt_tokens = len(tokens)
        else:  # stopped early: the rest at the last window's tokens per character
            span = consumed - before
            rate = len(piece) / span if span >= 256 else len(tokens) / consumed
            prompt_tokens = len(tokens) + round((len(text) - consumed) * rate)
        cached: dict[str, int] = {}
        first: dict[int, int] = {}
        sizes_of = index.block_size
        for bs, chain in chains.items():
            if chain:
                first[bs] = chain[0]
                for addr, n in index.match(chain).items():
                    if sizes_of.get(addr) == bs:
                        cached[addr] = n * bs
        return Prepared(prompt_tokens, cached, first, chains, rest)

    def _full_chain(self, prep: Prepared, bs: int) -> list[int]:
        """The request's chain for block size `bs` up to its last full block (or max_tokens):
        tokenization resumes where `prepare` stopped, for the chosen endpoint's size only."""
        chain = prep.chains.setdefault(bs, [])
        pieces, tokens, seed = prep.rest
        limit = self.max_tokens
        for piece, _ in pieces:
            tokens.extend(piece)
            if len(tokens) >= limit:
                break
        prep.rest = ((), tokens, seed)
        done, full = len(chain), min(len(tokens), limit) // bs
        if full > done:
            chain.extend(chain_hashes(tokens[done * bs:full * bs], bs,
                                      chain[-1] if chain else seed))
        return chain

    def _extend(self, chains: dict[int, list[int]], tokens: array, seed: int, limit: int) -> bool:
        """Hash the newly complete blocks of each block size; False once no in-sync endpoint
        holds the last block of any chain (nothing further can match)."""
        alive = False
        holds_any = self.index.holds_any
        for bs, chain in chains.items():
            done = len(chain)
            if done and not holds_any(chain[-1]):
                continue
            full = min(len(tokens), limit) // bs
            if full > done:
                chain.extend(chain_hashes(tokens[done * bs:full * bs], bs,
                                          chain[-1] if chain else seed))
            if not chain or holds_any(chain[-1]):
                alive = True
        return alive

    def apply_to(self, ctx: SchedulingContext, prep: Prepared) -> None:
        """The cached share of the prompt per in-sync endpoint, in the units of ctx.prompt_tokens
        (the picker's own estimate, which every load term and the profile's constants use), in
        whole blocks of the approximate index (ctx.block_size_tokens): where both indexes know
        the same, the scores are the same, and only what the engines tell beyond that changes a
        decision."""
        scale = ctx.prompt_tokens / prep.prompt_tokens if prep.prompt_tokens else 0.0
        bs = ctx.block_size_tokens
        ctx.precise = {a: int(n * scale) // bs * bs for a, n in prep.cached.items()}
        ctx.sync = self.index.reason

    def reported(self, prep: Prepared, ctx: SchedulingContext, address: str,
                 cached: int) -> tuple[int, int]:
        """(prompt tokens, cached tokens) of the decision in the tokenizer's units: the engine's
        own figure for an in-sync endpoint, else the approximate one converted."""
        if ctx.sync.get(address) == "":
            return prep.prompt_tokens, min(prep.prompt_tokens, prep.cached.get(address, 0))
        scale = prep.prompt_tokens / ctx.prompt_tokens if ctx.prompt_tokens else 0.0
        return prep.prompt_tokens, min(prep.prompt_tokens, round(cached * scale))

    def after_decision(self, prep: Prepared, address: str, now: float) -> None:
        """Remember this request's first block on its endpoint; settle the oldest checks: a
        first block found is a hit, one not found within the window a miss."""
        if self.index.in_sync(address):
            bs = self.index.block_size.get(address)
            if bs and self.inflight_ttl > 0 and prep.chains is not None:
                self.index.add_inflight(address, self._full_chain(prep, bs),
                                        now + self.inflight_ttl)
            h = prep.first.get(bs) if bs else None
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

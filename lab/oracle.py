"""The clairvoyant router: the limit of routing with a fixed pool, for comparison only.

It sees what no real router can: every engine's exact state (queues, KV blocks, prefix cache,
the step in flight) and every request's output length (the engines stop each request at its
`max_tokens`, and the oracle plays them forward). For each request it copies every candidate
engine, adds the request to the copy and runs the copy step by step until the request's first
token: that is the TTFT the request would get there if nothing else arrived after it. Requests
that arrive later cannot overtake it (the engine admits in FIFO order and preempts the newest
first); they can only share the steps of its last prefill chunks and make those steps longer,
so the figure is exact or a slight underestimate. It picks the group with the lowest TTFT; ties
(e.g. idle groups) go to the group with the least work left (prompt and output tokens still to
compute), which keeps KV for the requests to come.

Greedy per request, it is not a proof of optimality for the pool's mean: a choice that is best
for this request can delay later ones (its KV blocks). The matrix reports it next to the
picker; where the picker beats it, the greedy rule is what falls short.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Optional

from local.sim.engine import Engine, EngineRequest
from lab.policy_api import Deferred, LabEndpoint, LabRequest, Policy

MAX_STEPS = 20000        # a request not started after this many steps counts as never


def copy_engine(engine: Engine, clock) -> Engine:
    """An independent copy of the engine's scheduling state on `clock` (Engine.copy): it
    streams nothing, so a request's first token shows as its first_token_time."""
    return engine.copy(clock)


def predicted_ttft(ep: LabEndpoint, request: LabRequest, now: float,
                   limit: float = math.inf) -> float:
    """Seconds from now to the request's first token if sent to ep now (see above);
    inf once the copy's time passes now + limit (no need to know how much worse it is)."""
    # A group whose queue alone takes longer than the limit is not played forward (the same
    # inf; the margin keeps float rounding of the two sums from deciding).
    if limit < math.inf and ttft_lower_bound(ep, request, now) > limit + 1e-6:
        return math.inf
    t = [max(now, ep.step_end) if ep.busy else now]
    engine = copy_engine(ep.engine, lambda: t[0])
    try:
        target = engine.add_request(request.request_id, request.token_ids, request.max_tokens,
                                    hashes=request.hashes)
    except ValueError:
        return math.inf
    return play_to_first_token(engine, target, t, now, limit)


def play_to_first_token(engine: Engine, target: EngineRequest, t: list, now: float,
                        limit: float = math.inf) -> float:
    """Step a copy (copy_engine, its clock reading t[0]) until `target`, one of its requests,
    has its first token: seconds from now to that token, inf once the copy's time passes
    now + limit, when the engine runs dry or after MAX_STEPS steps. A copy streams nothing:
    the target's first_token_time says when its first token came."""
    past = lambda end: end - now > limit  # noqa: E731
    steps = 0
    while steps < MAX_STEPS:
        # Stretches where the engine only decodes (the request still queued) in one call.
        run = engine.decode_run(MAX_STEPS - steps, past)
        if run is not None:
            steps += run[0]
            t[0] = run[1]
            if past(t[0]):
                return math.inf
            continue
        result = engine.step()
        steps += 1
        if result is None:
            return math.inf
        t[0] = result.end_time
        if past(t[0]):
            return math.inf
        if target.first_token_time is not None:
            return result.end_time - now
    return math.inf


def ttft_lower_bound(ep: LabEndpoint, request: LabRequest, now: float) -> float:
    """A bound the request's TTFT on ep cannot beat, from the prefill that must run first.

    Admission is FIFO and a step gives its token budget to the running requests in order, the
    new one last: its first token comes in a step where every request admitted or queued before
    it has finished its prefill. Each request's prefill left is at least what it has left now
    (or, if it is preempted and recomputes, its prompt minus the most the prefix cache can
    hold of it: all but its last token's block); the new request's likewise. Those T tokens take
    at least ceil(T / budget) steps and each step at least its base time plus its prefill
    tokens' time (decode and context terms only add), after the step in flight ends."""
    engine = ep.engine
    p = engine.engine_model
    bs = p.block_size
    caching = p.enable_prefix_caching

    def least_prefill(prefill_len: int, hashes: list) -> int:
        return prefill_len - min(len(hashes), (prefill_len - 1) // bs) * bs if caching \
            else prefill_len

    tokens = least_prefill(len(request.token_ids), request.hashes)
    for r in engine.waiting:
        tokens += least_prefill(r.prefill_len, r.block_hashes)
    for r in engine.running:
        if r.num_computed < r.prefill_len:
            tokens += min(r.prefill_len - r.num_computed, least_prefill(r.prefill_len,
                                                                        r.block_hashes))
    steps = -(-tokens // p.max_num_batched_tokens)
    start = max(now, ep.step_end) if ep.busy else now
    return start - now + p.pipeline_stages * (p.stage_base_s * steps
                                              + p.stage_prefill_token_s * tokens)


def work_left(engine: Engine) -> int:
    """Tokens still to compute on the engine: prefill left plus output left, over its requests."""
    return sum(r.prefill_len - min(r.num_computed, r.prefill_len) + r.stop_at - r.num_output
               for r in engine.requests.values())


class Oracle(Policy):
    name = "oracle"

    def pick(self, request: LabRequest) -> LabEndpoint:
        now = self.clock()
        best, best_key = None, (math.inf, math.inf)
        # Likely winners first (short queues), so the bound cuts the other simulations short.
        for ep in sorted(self.endpoints, key=lambda e: (len(e.engine.waiting), e.engine.used)):
            key = (predicted_ttft(ep, request, now, best_key[0]), work_left(ep.engine))
            if best is None or key < best_key:
                best, best_key = ep, key
        return best


def can_start_now(ep: LabEndpoint, request: LabRequest, memo: Optional[dict] = None) -> bool:
    """The engine would admit the request at its next step: nothing waiting ahead of it, a free
    batch slot, and KV blocks for its uncached prompt above the watermark (exact state).
    `memo` (a dict the caller keeps) remembers each engine's cached prefix of the request."""
    engine = ep.engine
    p = engine.engine_model
    if engine.waiting or len(engine.running) >= p.max_num_seqs:
        return False
    bs = p.block_size
    room = p.num_gpu_blocks - engine.used - engine.watermark_blocks   # blocks it may take
    blocks = -(-len(request.token_ids) // bs)
    if blocks <= room or not p.enable_prefix_caching:     # fits without any cache hit
        return blocks <= room
    limit = min(len(request.hashes), (len(request.token_ids) - 1) // bs)
    if blocks - limit > room:                             # not even with every block cached
        return False
    return blocks - cached_prefix(engine, request, limit, memo) <= room


def cached_prefix(engine: Engine, request: LabRequest, limit: int,
                  memo: Optional[dict] = None) -> int:
    """How many of the request's first `limit` blocks the engine's cache holds. With `memo`, a
    count made at the same cache epoch is reused, and one made before only blocks were added
    (no eviction since) is where the count resumes, as Engine._prefix_hits does."""
    hits, key = 0, (id(engine), request.request_id)
    seen = memo.get(key) if memo is not None else None
    if seen is not None and seen[0] is engine:
        if seen[1] == engine.cache_epoch:
            return seen[3]
        if seen[2] == engine.evictions:
            hits = seen[3]
    refs, hashes = engine.refs, request.hashes
    while hits < limit and hashes[hits] in refs:
        hits += 1
    if memo is not None:
        memo[key] = (engine, engine.cache_epoch, engine.evictions, hits)
    return hits


class LateOracle(Oracle):
    """The oracle that may hold (late binding): a request goes only to a group that would start
    it at once (can_start_now, exact engine state), chosen by the oracle's rule among those;
    while no group can, it waits at the gateway, FIFO, and is retried whenever an engine step
    ends. Requests that no idle group could ever admit go at once (no deadlock)."""

    name = "oracle-late"

    def start(self, endpoints, clock, rng):
        super().start(endpoints, clock, rng)
        self.held: deque = deque()
        self.cached: dict = {}        # can_start_now's memo (the held request, every wake-up)

    def _room(self, request: LabRequest) -> list[LabEndpoint]:
        return [ep for ep in self.endpoints if can_start_now(ep, request, self.cached)]

    def pick(self, request: LabRequest) -> LabEndpoint:
        room = self._room(request) if not self.held else []
        if room:
            return self._best(room, request)
        if not self.held and all(not ep.busy for ep in self.endpoints):
            return super().pick(request)  # nothing running anywhere: holding cannot help
        self.held.append(request)
        raise Deferred()

    def _best(self, eps: list[LabEndpoint], request: LabRequest) -> LabEndpoint:
        all_eps, self.endpoints = self.endpoints, eps
        try:
            return super().pick(request)
        finally:
            self.endpoints = all_eps

    def next_wakeup(self):
        if not self.held:
            return None
        ends = [ep.step_end for ep in self.endpoints if ep.busy]
        return min(ends) if ends else self.clock()

    def wake(self):
        # The lab adds the requests handed out here to their engines after wake() returns: at
        # most one per group per wake-up, as each makes its group's queue non-empty.
        out, taken = [], set()
        if len(self.cached) > 4096:
            self.cached.clear()
        while self.held:
            request = self.held[0]
            room = [ep for ep in self._room(request) if ep.index not in taken]
            if not room and (taken or any(ep.busy for ep in self.endpoints)):
                break
            self.held.popleft()
            ep = self._best(room, request) if room else super().pick(request)
            taken.add(ep.index)
            out.append((request, ep))
        return out

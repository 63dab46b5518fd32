"""A vLLM engine model at the level of scheduler iterations. No HTTP, no asyncio, no wall clock.

The driver (the HTTP server in real or scaled time, the lab in virtual time) owns time:

    engine = Engine(engine_model, clock)
    engine.add_request("r1", token_ids, max_tokens=100)
    result = engine.step()            # plans and applies one iteration, returns its duration
    # the driver advances time by result.duration_s, then delivers result.outputs

`step()` applies the iteration at once; every token it produces is stamped with
`result.end_time = clock() + duration_s`, which is when the driver delivers it. Histograms (TTFT,
inter-token, end-to-end) use those stamps, so they read in model seconds whatever the speedup.

Model (what vLLM's scheduler does, simplified where noted):
- Continuous batching: each step serves running requests first (one decode token each, or the
  next prefill chunk), then admits waiting requests in FIFO order while `max_num_seqs` and the
  token budget `max_num_batched_tokens` allow; prefill is chunked to fit the budget.
- KV cache in blocks of `block_size` tokens with a fixed count. A waiting request is admitted only
  when blocks for its whole prompt (minus prefix-cache hits) are free above a watermark
  (vLLM V0's rule; V1 allocates per chunk). Decoding takes a new block every `block_size` tokens;
  when none is free the newest running request is preempted: its blocks are freed and it returns
  to the head of the queue to recompute prompt + generated tokens later.
- Prefix cache: full blocks are keyed by chained hashes of their token ids (unsigned 64-bit, like
  vLLM's). Once computed they are shared, prompt blocks and blocks filled by generated tokens
  alike; blocks nobody references stay cached and are evicted LRU when space is needed. A
  finished request frees its blocks tail first, so within a cached prefix the tail is evicted
  first (vLLM's order). Blocks freed without a hash (partial, or duplicates of a block another
  request cached first) are reused before any cached block is evicted (vLLM keeps one LRU queue
  for both; a simplification).
- KV-cache events (`Engine(..., kv_events=True)`): the allocator records, in order,
  `BlockStored` (blocks that became cached: hashes, parent hash, token ids), `BlockRemoved` (one
  per evicted block) and `AllBlocksCleared` (`reset_prefix_cache`), as vLLM's block pool does;
  the driver drains them with `take_kv_events()` after each step and publishes them
  (local/sim/kv_events.py). Generated tokens are `output_token(seed, index)` ids, `seed` being
  the CRC-32 of the request id (the ids of the words the HTTP server streams).
- Step time per stage = base + prefill tokens + decoding sequences + context tokens attended, each
  times a constant; pipeline stages run in series for one batch.

Why one file of this size: the scheduler, the block allocator and its events change the same
per-step state (running, waiting, free and cached blocks) in one order, as vLLM's do; split, every
step would cross module boundaries for each block.
"""

from __future__ import annotations

import bisect
import time
import zlib
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional, Sequence

from local.sim.engines import EngineModel
from local.sim.tokens import filler_word_id, filler_word_ids

HASH_MASK = (1 << 64) - 1           # block hashes are unsigned 64-bit integers, as vLLM publishes

# vLLM's histogram buckets (vllm/v1/metrics/loggers.py).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class Histogram:
    """Bucket counts of observations (upper bounds inclusive, like Prometheus)."""

    __slots__ = ("bounds", "counts", "sum", "count")

    def __init__(self, bounds: Sequence[float]):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # last slot = +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        out, acc = [], 0
        for bound, n in zip(self.bounds + (float("inf"),), self.counts):
            acc += n
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), acc))
        return out


class StepOutput(NamedTuple):
    request_id: str
    first_token: bool          # this step produced the request's first token
    finished: bool
    finish_reason: Optional[str]  # "stop" | "length" when finished
    num_output_tokens: int     # tokens generated so far (this step produced exactly one)


class StepResult(NamedTuple):
    duration_s: float
    end_time: float
    outputs: list              # list[StepOutput]; empty for an engine made with stream=False
    num_prefill_tokens: int
    num_decode_seqs: int
    finished: list = []        # the requests (EngineRequest) this step finished, in output order


# A stretch's block events as ints: step << _STEP_SHIFT | _PUBLISH (else an allocation) | the
# request's position among the running ones (fewer than max_num_batched_tokens).
_STEP_SHIFT, _PUBLISH, _POSITION = 33, 1 << 32, (1 << 32) - 1
_RUN_HORIZON = 128          # steps planned at once (see Engine._plan_decode_run)


class _DecodeRun:
    """A planned stretch of decode steps (Engine._plan_decode_run) and how far it has got."""

    __slots__ = ("requests", "n", "steps", "events", "next_event", "watch", "context",
                 "start_computed", "ends", "applied", "synced")

    def __init__(self, requests: list, steps: int, events: list, watch: Optional[int],
                 context: int):
        self.requests = requests             # the running requests, in order
        self.n = len(requests)
        self.steps = steps                   # planned length (cut short if `watch` appears)
        self.events = events                 # step << _STEP_SHIFT | _PUBLISH or not | position,
        self.next_event = 0                  # sorted
        self.watch = watch
        self.context = context               # tokens the next step attends to
        self.start_computed = [r.num_computed for r in requests]
        self.ends: list[float] = []          # each applied step's end time
        self.applied = 0                     # steps applied to the blocks and the clock
        self.synced = 0                      # steps applied to the requests' counters


class BlockStored(NamedTuple):
    """Blocks that became cached, in chain order (vLLM's BlockStored)."""
    block_hashes: list
    parent_block_hash: Optional[int]   # the block before the first one; None at a prompt's start
    token_ids: list                    # block_size ids per block, concatenated
    block_size: int


class BlockRemoved(NamedTuple):
    """A cached block was evicted (one per block, as vLLM publishes evictions)."""
    block_hashes: list


class AllBlocksCleared(NamedTuple):
    """The prefix cache was reset."""


def default_output_token(seed: int, index: int) -> int:
    """Token id of generated token `index`: the word the HTTP server streams, as the simulator's
    word tokenizer numbers it."""
    return filler_word_id(seed, index)


class EngineRequest:
    __slots__ = ("request_id", "prompt_len", "token_ids", "output_seed", "block_hashes",
                 "max_tokens", "stop_at",
                 "num_output", "num_computed", "prefill_len", "hashed", "private",
                 "registered", "arrival_time", "first_token_time", "last_token_time",
                 "finished", "finish_reason", "num_preemptions", "num_cached_tokens",
                 "token_gaps", "_hit_epoch", "_hit_blocks", "_hit_evictions")

    def __init__(self, request_id: str, prompt_len: int, block_hashes: list, max_tokens: int,
                 stop_at: int, arrival_time: float, token_ids: Sequence[int] = ()):
        self.request_id = request_id
        self.prompt_len = prompt_len
        self.token_ids = token_ids          # the prompt's (not copied: never changed)
        self.output_seed = zlib.crc32(request_id.encode())
        # Hashes of the full blocks, prompt first, then blocks filled by generated tokens,
        # appended as they fill. A function of the prompt and the request id alone (generated
        # token i is output_token(output_seed, i)), so copies of the request (Engine.copy)
        # share the list: what one appends is what the others would compute.
        self.block_hashes = block_hashes
        self.max_tokens = max_tokens
        self.stop_at = stop_at              # output length at which generation ends
        self.num_output = 0
        self.num_computed = 0               # tokens whose KV is computed
        self.prefill_len = prompt_len       # tokens to (re)compute before sampling
        self.hashed: list = []              # cache-shared blocks this request references
        self.private = 0                    # blocks owned by this request only
        self.registered = 0                 # prompt blocks already matched or published
        self.arrival_time = arrival_time
        self.first_token_time: Optional[float] = None
        self.last_token_time: Optional[float] = None
        self.finished = False
        self.finish_reason: Optional[str] = None
        self.num_preemptions = 0
        self.num_cached_tokens = 0          # prefix-cache hit tokens at (first) admission
        self.token_gaps: list = []          # seconds between its tokens (stream=False engines)
        # _prefix_hits' cache: the count at cache epoch _hit_epoch, and a lower bound while no
        # block has been evicted since (eviction count _hit_evictions)
        self._hit_epoch = -1
        self._hit_blocks = 0
        self._hit_evictions = -1

    @property
    def num_blocks(self) -> int:
        return len(self.hashed) + self.private

    def copy(self) -> "EngineRequest":
        """The request in a copied engine (Engine.copy): every field, its own list of cached
        blocks, no token times, the same block hashes (see __init__). Written out
        (not a loop over __slots__): the oracle copies thousands of requests per run;
        local/tests/test_engine.py checks that every slot is copied."""
        c = EngineRequest.__new__(EngineRequest)
        c.request_id, c.prompt_len, c.token_ids = self.request_id, self.prompt_len, self.token_ids
        c.output_seed, c.block_hashes = self.output_seed, self.block_hashes    # shared
        c.max_tokens, c.stop_at = self.max_tokens, self.stop_at
        c.num_output, c.num_computed = self.num_output, self.num_computed
        c.prefill_len, c.hashed, c.private = self.prefill_len, list(self.hashed), self.private
        c.registered, c.arrival_time = self.registered, self.arrival_time
        c.first_token_time, c.last_token_time = self.first_token_time, self.last_token_time
        c.finished, c.finish_reason = self.finished, self.finish_reason
        c.num_preemptions, c.num_cached_tokens = self.num_preemptions, self.num_cached_tokens
        c.token_gaps = []               # the copy's own (its steps must not reach the original's)
        c._hit_epoch = c._hit_evictions = -1     # hit counts are per engine object
        c._hit_blocks = 0
        return c


def block_hashes(token_ids: Sequence[int], block_size: int, salt: int = 0) -> list:
    """Chained hashes of the full blocks of `token_ids`, unsigned 64-bit (tuple hashes of ints
    are stable across processes, unlike str hashes)."""
    hashes, prev = [], salt
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev = hash((prev, *token_ids[start:start + block_size])) & HASH_MASK
        hashes.append(prev)
    return hashes


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float            # 0..1, blocks referenced by requests / capacity
    num_gpu_blocks: int
    block_size: int
    prefix_cache_queries: int        # tokens
    prefix_cache_hits: int           # tokens
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    request_success: dict = field(default_factory=dict)   # finish_reason -> count


class Engine:
    """`stream=True` (the HTTP server): every step returns one StepOutput per token produced and
    the engine keeps vLLM's latency histograms. `stream=False` (the lab, which reads neither):
    a step returns only the requests it finished (`StepResult.finished`), each with its tokens'
    times (first_token_time, token_gaps, last_token_time): the same figures, fewer objects.
    `decode_runs=True` (not streaming only): stretches of pure decode steps are planned once
    and their steps applied without a pass over the requests (see "stretches" below); the
    requests' counters then lag until `sync()`, which a driver calls before reading them."""

    def __init__(self, engine_model: EngineModel, clock: Callable[[], float] = time.monotonic,
                 kv_events: bool = False,
                 output_token: Callable[[int, int], int] = default_output_token,
                 stream: bool = True, decode_runs: bool = False):
        if stream and decode_runs:
            raise ValueError("decode_runs needs stream=False (a stretch streams no outputs)")
        self.engine_model = engine_model
        self.clock = clock
        self.stream = stream
        self.token_times = not stream     # each request's token_gaps (a copy keeps none)
        self.decode_runs = decode_runs
        self._run: Optional[_DecodeRun] = None   # the stretch of decode steps in progress
        self.kv_events: Optional[list] = [] if kv_events else None   # recorded, not yet taken
        self.output_token = output_token
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.requests: dict[str, EngineRequest] = {}
        # KV blocks: `used` = referenced by some request; `evictable` = cached, unreferenced (LRU).
        self.used = 0
        self.refs: dict[int, int] = {}          # block hash -> reference count
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.cache_epoch = 0                     # bumps whenever the set of cached hashes changes
        self.evictions = 0                       # bumps whenever cached hashes are dropped
        self._compacted_at = 0                   # evictions when refs was last rebuilt (copy)
        self.watermark_blocks = int(engine_model.watermark * engine_model.num_gpu_blocks)
        # counters
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_preemptions = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.request_success: dict[str, int] = {}
        self.version = 0                         # bumps on every state change (for render caches)
        self.ttft = Histogram(TTFT_BUCKETS)
        self.itl = Histogram(ITL_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    # ----- requests -------------------------------------------------------------------------

    def add_request(self, request_id: str, token_ids: Sequence[int], max_tokens: int,
                    stop_at: Optional[int] = None, hashes: Optional[list] = None) -> EngineRequest:
        """Queue a request. `stop_at` = output length where EOS falls (None: run to max_tokens).

        `hashes` may pass precomputed `block_hashes(token_ids, block_size)` to save time.
        Raises ValueError for an empty prompt, max_tokens < 1, or a length over max_model_len.
        """
        p = self.engine_model
        prompt_len = len(token_ids)
        if prompt_len < 1:
            raise ValueError("prompt must contain at least one token")
        if max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if prompt_len + max_tokens > p.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {p.max_model_len} tokens. However, you "
                f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the messages, "
                f"{max_tokens} in the completion). Please reduce the length of the messages or "
                f"completion.")
        needed = -(-(prompt_len + max_tokens) // p.block_size)
        if needed > p.num_gpu_blocks - int(p.watermark * p.num_gpu_blocks):
            raise ValueError(f"request needs {needed} KV blocks but the cache holds "
                             f"{p.num_gpu_blocks}")
        if request_id in self.requests:
            raise ValueError(f"duplicate request id {request_id!r}")
        self._end_run()
        if hashes is None:
            hashes = block_hashes(token_ids, p.block_size) if p.enable_prefix_caching else []
        else:
            hashes = list(hashes)      # its own: the blocks it generates are appended to it
        stop = max_tokens if stop_at is None else max(1, min(stop_at, max_tokens))
        req = EngineRequest(request_id, prompt_len, hashes, max_tokens, stop, self.clock(),
                            token_ids)
        self.requests[request_id] = req
        self.waiting.append(req)
        self.prompt_tokens += prompt_len
        self.version += 1
        return req

    def abort(self, request_id: str) -> bool:
        if request_id not in self.requests:
            return False
        self._end_run()
        req = self.requests.pop(request_id)
        if req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self._free(req)
        req.finished, req.finish_reason = True, "abort"
        self.request_success["abort"] = self.request_success.get("abort", 0) + 1
        self.version += 1
        return True

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # ----- KV-cache events ------------------------------------------------------------------

    def copy(self, clock: Callable[[], float]) -> "Engine":
        """An independent copy of the scheduling state (not its histograms or counters) on
        `clock`, that streams and publishes nothing and plays stretches of decode steps at once
        (decode_run): what the oracle plays forward."""
        self.sync()
        if self.evictions - self._compacted_at > 256:
            # dict.copy() is a plain memory copy only while the dict has few holes; evictions
            # leave holes: a fresh dict (same items, same order) has none.
            self.refs, self._compacted_at = dict(self.refs), self.evictions
        c = Engine.__new__(Engine)
        c.engine_model, c.clock = self.engine_model, clock
        c.kv_events, c.output_token = None, self.output_token
        c.stream = c.decode_runs = c.token_times = False
        c._run = None
        requests = {rid: r.copy() for rid, r in self.requests.items()}
        c.requests = requests
        c.waiting = deque(requests[r.request_id] for r in self.waiting)
        c.running = [requests[r.request_id] for r in self.running]
        c.used = self.used
        c.refs = self.refs.copy()
        c.evictable = self.evictable.copy()
        c.cache_epoch, c.evictions, c._compacted_at = self.cache_epoch, self.evictions, 0
        c.watermark_blocks = self.watermark_blocks
        c.prefix_cache_queries = c.prefix_cache_hits = c.num_preemptions = 0
        c.prompt_tokens = c.generation_tokens = 0
        c.request_success = {}
        c.version = 0
        return c

    def take_kv_events(self) -> list:
        """The events recorded since the last call, in order (empty when not recording)."""
        events = self.kv_events
        if not events:
            return []
        self.kv_events = []
        return events

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block nobody references (vLLM's reset_prefix_cache). Like vLLM, it
        refuses (False) while requests hold blocks."""
        if self.used:
            return False
        for h in self.evictable:
            del self.refs[h]
        self.evictable.clear()
        self.cache_epoch += 1
        self.evictions += 1
        if self.kv_events is not None:
            self.kv_events.append(AllBlocksCleared())
        self.version += 1
        return True

    def _block_tokens(self, req: EngineRequest, index: int) -> Sequence[int]:
        """Token ids of full block `index` of the request: prompt, then generated tokens."""
        bs = self.engine_model.block_size
        start, end = index * bs, (index + 1) * bs
        prompt_len = req.prompt_len
        out = list(req.token_ids[start:end])
        if end > prompt_len:
            first, stop = max(start, prompt_len) - prompt_len, end - prompt_len
            if self.output_token is default_output_token:
                if start >= prompt_len:     # all generated: the (cached, immutable) tuple
                    return filler_word_ids(req.output_seed, first, stop)
                out += filler_word_ids(req.output_seed, first, stop)
            else:
                seed, token = req.output_seed, self.output_token
                out += [token(seed, i) for i in range(first, stop)]
        return out

    # ----- KV blocks ------------------------------------------------------------------------

    def _allocate(self, n: int) -> None:
        """Take n fresh blocks, evicting least recently used cached blocks if needed."""
        empty = self.engine_model.num_gpu_blocks - self.used - len(self.evictable)
        if empty < n:
            events = self.kv_events
            for _ in range(n - empty):
                h, _ = self.evictable.popitem(last=False)
                del self.refs[h]
                if events is not None:
                    events.append(BlockRemoved([h]))
            self.cache_epoch += 1
            self.evictions += 1
        self.used += n

    def _free(self, req: EngineRequest) -> None:
        refs, evictable = self.refs, self.evictable
        for h in reversed(req.hashed):      # tail first: the tail is evicted before the head
            c = refs[h] - 1
            refs[h] = c
            if c == 0:
                evictable[h] = None       # most recently used at the end
                self.used -= 1
        self.used -= req.private
        req.hashed = []
        req.private = 0
        req.registered = 0

    def _prefix_hits(self, req: EngineRequest) -> int:
        """Blocks of the request's prefill already in the cache (at least one token left to compute)."""
        if req._hit_epoch == self.cache_epoch:
            return req._hit_blocks
        limit = min(len(req.block_hashes), (req.prefill_len - 1) // self.engine_model.block_size)
        # Blocks only joined the cache since the last count (none left it): those hits still hold.
        k = min(req._hit_blocks, limit) if req._hit_evictions == self.evictions else 0
        refs, hashes = self.refs, req.block_hashes
        while k < limit and hashes[k] in refs:
            k += 1
        req._hit_epoch, req._hit_blocks, req._hit_evictions = self.cache_epoch, k, self.evictions
        return k

    def _try_admit(self, req: EngineRequest) -> bool:
        p = self.engine_model
        bs = p.block_size
        total_blocks = -(-req.prefill_len // bs)
        free = p.num_gpu_blocks - self.used
        # Cheap rejection before looking at the cache: even the best case does not fit.
        best_hits = min(len(req.block_hashes), (req.prefill_len - 1) // bs)
        if free - (total_blocks - best_hits) < self.watermark_blocks:
            return False
        hits = self._prefix_hits(req) if p.enable_prefix_caching else 0
        new_blocks = total_blocks - hits
        if free - new_blocks < self.watermark_blocks:     # fails whatever `revived` below is
            return False
        hit_hashes = req.block_hashes[:hits]
        evictable = self.evictable
        # Hits that are cached but unreferenced take a block back from the free ones; count them
        # only when it matters (admitted whatever their number otherwise).
        if free - hits - new_blocks < self.watermark_blocks:
            revived = sum(map(evictable.__contains__, hit_hashes))
            if free - revived - new_blocks < self.watermark_blocks:
                return False
        refs = self.refs
        for h in hit_hashes:
            c = refs[h]
            if c == 0:
                del evictable[h]
                self.used += 1
            refs[h] = c + 1
        self._allocate(new_blocks)
        req.hashed = hit_hashes
        req.private = new_blocks
        req.registered = hits
        req.num_computed = hits * bs
        self.prefix_cache_queries += req.prefill_len
        self.prefix_cache_hits += hits * bs
        if req.num_output == 0 and req.num_preemptions == 0:
            req.num_cached_tokens = hits * bs
        return True

    def _publish_blocks(self, req: EngineRequest) -> None:
        """Make the request's newly computed full blocks shareable through the cache."""
        bs = self.engine_model.block_size
        full = req.num_computed // bs
        if full <= req.registered:
            return
        hashes = req.block_hashes
        if full > len(hashes):             # blocks filled by generated tokens: hash them now
            prev = hashes[-1] if hashes else 0
            for k in range(len(hashes), full):
                prev = hash((prev, *self._block_tokens(req, k))) & HASH_MASK
                hashes.append(prev)
        refs, events = self.refs, self.kv_events
        stored: list = []                  # indexes of the blocks this call caches
        for k in range(req.registered, full):
            h = hashes[k]
            if h not in refs:          # else another request computed the same block first
                refs[h] = 1
                req.hashed.append(h)
                req.private -= 1
                self.cache_epoch += 1
                stored.append(k)
        req.registered = full
        if events is not None and stored:
            self._record_stored(req, stored)

    def _record_stored(self, req: EngineRequest, indexes: list) -> None:
        """One BlockStored per run of consecutive blocks (vLLM: one per request and step)."""
        bs, hashes = self.engine_model.block_size, req.block_hashes
        run = [indexes[0]]
        for k in indexes[1:] + [None]:
            if k is not None and k == run[-1] + 1:
                run.append(k)
                continue
            first = run[0]
            tokens: list = []
            for i in run:
                tokens.extend(self._block_tokens(req, i))
            self.kv_events.append(BlockStored([hashes[i] for i in run],
                                              hashes[first - 1] if first else None, tokens, bs))
            run = [k]

    def _preempt(self, req: EngineRequest) -> None:
        self._free(req)
        req.num_computed = 0
        req.prefill_len = req.prompt_len + req.num_output
        req.num_preemptions += 1
        req._hit_epoch = req._hit_evictions = -1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ----- one scheduler iteration --------------------------------------------------------

    def step(self) -> Optional[StepResult]:
        """Run one iteration. None when there is nothing to run."""
        run = self._run
        if run is None and self.decode_runs:
            run = self._run = self._plan_decode_run(_RUN_HORIZON)
        if run is not None:
            duration, end = self._run_steps(run, self.clock())
            if run.applied >= run.steps:
                self.sync()
            return StepResult(duration, end, [], 0, run.n, [])
        running = self.running
        if not (running or self.waiting):
            return None
        # The hottest loop of the lab: attributes read once into locals, one pass per phase.
        p = self.engine_model
        bs = p.block_size
        num_gpu_blocks = p.num_gpu_blocks
        budget = p.max_num_batched_tokens
        scheduled: list[tuple[EngineRequest, int]] = []
        prefill_tokens = decode_seqs = context = 0
        preempted = False

        for r in running:        # preemption below shortens the list from its end
            if budget <= 0:
                break
            computed = r.num_computed
            if computed < r.prefill_len:
                n = r.prefill_len - computed
                if n > budget:
                    n = budget
                budget -= n
                prefill_tokens += n
                context += computed + n
                scheduled.append((r, n))
                continue
            seq_len = r.prompt_len + r.num_output
            if seq_len > (len(r.hashed) + r.private) * bs:     # its next token needs a block
                while num_gpu_blocks - self.used < 1:
                    victim = running.pop()
                    self._preempt(victim)
                    preempted = True
                    if victim is r:
                        break
                if r.num_computed == 0:     # r itself was preempted
                    break
                self._allocate(1)
                r.private += 1
            budget -= 1
            decode_seqs += 1
            context += seq_len
            scheduled.append((r, 1))

        if not preempted:
            waiting = self.waiting
            while waiting and budget > 0 and len(running) < p.max_num_seqs:
                r = waiting[0]
                if not self._try_admit(r):
                    break
                waiting.popleft()
                running.append(r)
                n = min(r.prefill_len - r.num_computed, budget)
                budget -= n
                prefill_tokens += n
                context += r.num_computed + n
                scheduled.append((r, n))

        if not scheduled:   # cannot happen with add_request's capacity check; no spinning
            return None

        duration = p.pipeline_stages * (p.stage_base_s + p.stage_prefill_token_s * prefill_tokens
                                        + p.stage_decode_seq_s * decode_seqs
                                        + p.stage_context_token_s * context)
        end = self.clock() + duration
        stream, caching, token_times = self.stream, p.enable_prefix_caching, self.token_times
        outputs: list = []
        finished: list = []
        generated = 0
        for r, n in scheduled:
            computed = r.num_computed
            if computed < r.prefill_len:
                computed += n
                r.num_computed = computed
                if caching and computed >= (r.registered + 1) * bs:
                    self._publish_blocks(r)
                if computed < r.prefill_len:
                    continue
            else:
                computed += 1
                r.num_computed = computed
                if caching and computed % bs == 0:
                    self._publish_blocks(r)     # a block filled by generated tokens
            num_output = r.num_output + 1
            r.num_output = num_output
            generated += 1
            first = r.first_token_time is None
            if first:
                r.first_token_time = end
                if stream:
                    self.ttft.observe(end - r.arrival_time)
            elif stream:
                self.itl.observe(end - r.last_token_time)
            elif token_times:
                r.token_gaps.append(end - r.last_token_time)
            r.last_token_time = end
            if num_output >= r.stop_at:
                reason = "length" if num_output >= r.max_tokens else "stop"
                self._finish(r, reason, end)
                finished.append(r)
                if stream:
                    outputs.append(StepOutput(r.request_id, first, True, reason, num_output))
            elif stream:
                outputs.append(StepOutput(r.request_id, first, False, None, num_output))
        self.generation_tokens += generated
        if finished:
            self.running = [r for r in self.running if not r.finished]
        self.version += 1
        return StepResult(duration, end, outputs, prefill_tokens, decode_seqs, finished)

    # ----- stretches of pure decode steps ------------------------------------------------
    #
    # Most steps of a loaded engine only decode: the same running requests each add a token,
    # nothing is admitted, nothing finishes. Such a stretch is planned once (_plan_decode_run):
    # its length, and the few block allocations and cache publications its steps make, in the
    # order step() would make them. Each of its steps then costs those events and the step time
    # instead of a pass over every running request; the requests' token counts and times are
    # brought up to date in one pass (sync) when the stretch ends or someone looks at them.

    def decode_run(self, max_steps: int,
                   stop: Callable[[float], bool]) -> Optional[tuple[int, float]]:
        """Up to `max_steps` steps at once, while each would be a decode step of the same running
        requests that nothing interrupts (see _plan_decode_run). The state afterwards, the step
        times and the block events are those of that many step() calls, with the clock set to
        each step's end in turn. Stops after the first step whose end time makes `stop(end)`
        true. Returns (steps run, end time of the last), or None when the next step is not such
        a step. For an engine driven by nothing else meanwhile (the oracle's copies)."""
        if self.stream or self._run is not None:
            return None
        run = self._plan_decode_run(max_steps)
        if run is None:
            return None
        end = self._run_steps(run, self.clock(), max_steps, stop)[1]
        self._sync_run(run)
        return run.applied, end

    def sync(self) -> None:
        """Bring the requests of the stretch of decode steps in progress (decode_runs=True) up to
        the steps applied so far: read an engine's requests only after this."""
        run = self._run
        if run is not None:
            self._sync_run(run)
            if run.applied >= run.steps:
                self._run = None

    def _end_run(self) -> None:
        """Someone changes the engine (a request added or aborted): the stretch stops after the
        step applied last; the next step is planned anew."""
        run = self._run
        if run is not None:
            self._sync_run(run)
            self._run = None

    def _plan_decode_run(self, max_steps: int) -> Optional[_DecodeRun]:
        """The stretch of decode steps starting with the next step, None if it is not one: every
        running request decodes, none finishes, no block runs out (no preemption) and the waiting
        queue's head cannot be admitted."""
        running = self.running
        p = self.engine_model
        n = len(running)
        if not running or n > p.max_num_batched_tokens:
            return None
        bs = p.block_size
        for r in running:
            if r.num_computed < r.prefill_len:
                return None
        waiting = self.waiting
        watch = None           # a hash whose caching could let the head in: stop if it appears
        if waiting and n < p.max_num_batched_tokens and n < p.max_num_seqs:
            # The head must fail _try_admit's block tests at every step. Decoding only takes
            # free blocks, and evicting a cached block of the head's prefix only adds to what
            # the head needs (its blocks not referenced by a running request), so they keep
            # failing while the head's cached prefix does not grow, i.e. until a step caches
            # the next block of its prompt (`watch`).
            head = waiting[0]
            total, limit = -(-head.prefill_len // bs), min(len(head.block_hashes),
                                                           (head.prefill_len - 1) // bs)
            free = p.num_gpu_blocks - self.used
            if free - (total - limit) >= self.watermark_blocks:
                hits = self._prefix_hits(head) if p.enable_prefix_caching else 0
                if free - (total - hits) >= self.watermark_blocks:
                    revived = sum(map(self.evictable.__contains__, head.block_hashes[:hits]))
                    if free - revived - (total - hits) >= self.watermark_blocks:
                        return None
                if p.enable_prefix_caching and hits < limit:
                    watch = head.block_hashes[hits]
        # At most _RUN_HORIZON steps at a time: a longer stretch is planned again from where it
        # got (the same steps), and a request added meanwhile cuts it short (planned in vain).
        steps = min(max_steps, _RUN_HORIZON, min(r.stop_at - r.num_output for r in running) - 1)
        if steps <= 0:
            return None
        # Each request's block allocations and cache publications in these steps, in the order
        # step() makes them: by step, allocations (scheduling) before publications (applying),
        # each in running order.
        # Events are ints that sort in that order: step << _STEP_SHIFT | kind | position.
        allocations: list = []
        publications: list = []
        for pos, r in enumerate(running):
            seq_len, blocks = r.prompt_len + r.num_output, len(r.hashed) + r.private
            j = max(0, blocks * bs - seq_len + 1)
            while j < steps:
                allocations.append(j << _STEP_SHIFT | pos)
                blocks += 1
                j = max(j + 1, blocks * bs - seq_len + 1)
            if p.enable_prefix_caching:
                publications += [j << _STEP_SHIFT | _PUBLISH | pos
                                 for j in range((-r.num_computed - 1) % bs, steps, bs)]
        allocations.sort()
        free = p.num_gpu_blocks - self.used
        if len(allocations) > free:              # the step of the first one without a block
            steps = allocations[free] >> _STEP_SHIFT     # preempts: stop before it
            if steps <= 0:
                return None
            del allocations[free:]
        events = allocations + publications
        events.sort()
        return _DecodeRun(list(running), steps, events, watch,
                          sum(r.prompt_len + r.num_output for r in running))

    def _run_steps(self, run: _DecodeRun, start: float, count: int = 1,
                   stop: Optional[Callable[[float], bool]] = None) -> tuple[float, float]:
        """Apply up to `count` of the stretch's next steps, the first starting at `start` and each
        at the previous one's end; stop after a step whose end makes `stop(end)` true. Returns
        the last step's (duration, end time)."""
        p = self.engine_model
        # step()'s duration formula with the prefill and decode terms, fixed within the stretch,
        # added in its order once: the same sums.
        stages, context_s, n = p.pipeline_stages, p.stage_context_token_s, run.n
        fixed = p.stage_base_s + p.stage_prefill_token_s * 0 + p.stage_decode_seq_s * n
        events, e, ends = run.events, run.next_event, run.ends
        num_events, refs, watch = len(events), self.refs, run.watch
        requests, start_computed = run.requests, run.start_computed
        j, end, duration = run.applied, start, 0.0
        last = min(run.steps, j + count)
        while j < last:
            duration = stages * (fixed + context_s * run.context)
            end = end + duration
            while e < num_events and events[e] >> _STEP_SHIFT == j:
                event = events[e]
                e += 1
                pos = event & _POSITION
                r = requests[pos]
                if event & _PUBLISH:
                    r.num_computed = start_computed[pos] + j + 1
                    self._publish_blocks(r)
                    if watch is not None and watch in refs:
                        run.steps = last = j + 1    # the head may be admitted at the next step
                else:
                    self._allocate(1)
                    r.private += 1
            ends.append(end)
            run.context += n
            j += 1
            if stop is not None and stop(end):
                break
        run.next_event = e
        run.applied = j
        return duration, end

    def _sync_run(self, run: _DecodeRun) -> None:
        done, ends = run.synced, run.ends
        applied = run.applied
        if done == applied:
            return
        first, last = ends[done], ends[applied - 1]
        if self.token_times:
            gaps = [ends[i] - ends[i - 1] for i in range(done + 1, applied)]
            for r in run.requests:
                r.token_gaps.append(first - r.last_token_time)
                r.token_gaps += gaps
        for r, computed in zip(run.requests, run.start_computed):
            r.num_computed = computed + applied
            r.num_output += applied - done
            r.last_token_time = last
        self.generation_tokens += run.n * (applied - done)
        self.version += applied - done
        run.synced = applied

    def _finish(self, req: EngineRequest, reason: str, end: float) -> None:
        req.finished, req.finish_reason = True, reason
        self._free(req)
        del self.requests[req.request_id]
        if self.stream:
            self.e2e.observe(end - req.arrival_time)
        self.request_success[reason] = self.request_success.get(reason, 0) + 1

    # ----- gauges and counters --------------------------------------------------------------

    def kv_cache_usage(self) -> float:
        return self.used / self.engine_model.num_gpu_blocks

    def stats(self) -> EngineStats:
        self.sync()
        return EngineStats(
            num_running=len(self.running), num_waiting=len(self.waiting),
            kv_cache_usage=self.kv_cache_usage(), num_gpu_blocks=self.engine_model.num_gpu_blocks,
            block_size=self.engine_model.block_size,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits, num_preemptions=self.num_preemptions,
            prompt_tokens=self.prompt_tokens, generation_tokens=self.generation_tokens,
            request_success=dict(self.request_success))

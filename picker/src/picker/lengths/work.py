"""Each endpoint's predicted remaining work: the requests this picker sent there and has not seen
finish, their forecast lengths, and when their KV cache will free.

An entry is added when a request is decided and removed when its outcome arrives (Envoy's access
log; `Router.on_outcome`), or when it is so old that its outcome must have been lost. Between the
two, what a request has produced is estimated from its age and the endpoint's recent time per
output token, and what it still has to produce is its forecast's residual given that
(`Forecast.residual`).

`Projection` turns one endpoint's entries and its last scrape into the time at which a new
request would be admitted: vLLM admits a waiting request once blocks for its prompt are free;
blocks free when running requests end (all their blocks at once) and are taken meanwhile by
every running request's next tokens. Walking the predicted ends in order gives the free KV
after each; the first end after which the requests waiting ahead and the new one fit is the
wait.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

from picker.lengths.predictor import Forecast

# Before an endpoint's first outcome: the engine's time per output token and to first token
# (seconds; the A10 QwQ-32B deployment's order of magnitude, BENCHMARKS.md).
DEFAULT_TPOT = 0.12
DEFAULT_TTFT = 1.0
TIMING_ALPHA = 0.1          # EWMA weight of a new outcome's timings
PREFILL_CHUNK = 2048        # prompt tokens an engine prefills per step (vLLM's default budget)
MAX_ENDS = 64               # a projection looks this many predicted ends ahead at most
WATERMARK = 0.01            # KV share an engine keeps free when admitting (vLLM's default)
MAX_CALIBRATION = 4.0       # the produced-tokens correction from KV usage stays within 1/4..4x
MAX_ENTRIES = 2048          # requests tracked per endpoint at most (vLLM runs <= 256 at once)
LOST_AFTER_FACTOR = 4.0     # an entry older than this x its forecast's high quantile x TPOT ...
LOST_AFTER_MIN = 60.0       # ... and this many seconds has lost its outcome


@dataclass(slots=True)
class RunningEntry:
    address: str
    sent_at: float
    prompt_tokens: float     # its prompt's tokens not cached on the endpoint (engine tokens)
    forecast: Forecast
    counted: int = 0         # its whole prompt as the picker counts tokens (picker.openai)
    started_at: float | None = None   # the scrape that first showed it running (None: waiting)


@dataclass(slots=True)
class EndpointWork:
    entries: dict[str, RunningEntry] = field(default_factory=dict)   # request id -> entry
    tpot: float = DEFAULT_TPOT
    ttft: float = DEFAULT_TTFT
    timed: int = 0           # outcomes its timings were learned from
    version: int = 0         # bumped at every change of its entries or timings (projection cache)

    def produced(self, entry: RunningEntry, now: float) -> float:
        """Tokens a running request has produced: decode steps since it started, less the
        steps its prompt's prefill took (chunks of PREFILL_CHUNK tokens)."""
        since = entry.started_at if entry.started_at is not None else entry.sent_at + self.ttft
        return max(0.0, (now - since) / self.tpot - entry.prompt_tokens / PREFILL_CHUNK)

    def on_scrape(self, now: float, waiting: float) -> None:
        """An engine admits in arrival order and preempts the newest first: of the requests the
        picker sent there, all but the newest `waiting` run; those newly running started now."""
        entries = self.entries
        if not entries:
            return
        running = len(entries) - int(waiting)
        if running <= 0:
            return
        for e in sorted(entries.values(), key=lambda e: e.sent_at)[:running]:
            if e.started_at is None:
                e.started_at = now
                self.version += 1


class WorkTracker:
    """The requests in flight per endpoint, with their forecasts, and each endpoint's timings."""

    def __init__(self):
        self.endpoints: dict[str, EndpointWork] = {}
        self.by_id: dict[str, RunningEntry] = {}
        self.projections: dict[str, tuple] = {}     # address -> (key, Projection): Router's cache
        # Engine tokens per token the picker counts (~4 characters each; picker.openai): what
        # the outcomes' usage says the prompts were, over what the picker counted.
        self.token_ratio = 1.0
        self.ratios_learned = 0
        # Outcomes received: until the first, nothing is tracked (without an outcome path
        # entries would only end when reaped, and the projections would be fiction).
        self.outcomes = 0

    def learn_token_ratio(self, counted: int, engine_tokens: int) -> None:
        if counted > 0 and engine_tokens > 0:
            ratio = engine_tokens / counted
            a = TIMING_ALPHA if self.ratios_learned else 1.0
            self.token_ratio += a * (ratio - self.token_ratio)
            self.ratios_learned += 1

    def work(self, address: str) -> EndpointWork:
        w = self.endpoints.get(address)
        if w is None:
            w = self.endpoints[address] = EndpointWork()
        return w

    def add(self, request_id: str, address: str, sent_at: float, uncached: int, counted: int,
            forecast: Forecast) -> None:
        """A request sent to `address`: `uncached` and `counted` (its prompt not cached there,
        and all of it) in the picker's token counts."""
        entry = RunningEntry(address, sent_at, uncached * self.token_ratio, forecast, counted)
        self.by_id[request_id] = entry
        work = self.work(address)
        work.version += 1
        entries = work.entries
        entries[request_id] = entry
        if len(entries) > MAX_ENTRIES:     # outcomes lost on a grand scale: forget the oldest
            self.finish(next(iter(entries)))

    def finish(self, request_id: str) -> RunningEntry | None:
        entry = self.by_id.pop(request_id, None)
        if entry is not None:
            w = self.endpoints.get(entry.address)
            if w is not None:
                w.entries.pop(request_id, None)
                w.version += 1
        return entry

    def learn_timings(self, address: str, ttft: float | None, duration: float,
                      completion_tokens: int | None) -> None:
        """An outcome's time to first token and time per output token, for that endpoint."""
        if not completion_tokens or duration <= 0:
            return
        w = self.work(address)
        first = ttft if ttft is not None and 0 <= ttft <= duration else None
        if completion_tokens > 1 and first is not None:
            tpot = (duration - first) / (completion_tokens - 1)
        elif first is None:
            tpot = duration / completion_tokens
        else:
            tpot = None
        a = TIMING_ALPHA if w.timed else 1.0
        w.version += 1
        if tpot is not None and tpot > 0:
            w.tpot += a * (tpot - w.tpot)
        if first is not None:
            w.ttft += a * (first - w.ttft)
        w.timed += 1

    def forget(self, address: str) -> None:
        self.projections.pop(address, None)
        w = self.endpoints.pop(address, None)
        if w is not None:
            for rid in w.entries:
                self.by_id.pop(rid, None)

    def reap(self, now: float) -> int:
        """Drop entries whose outcome must have been lost (far past any forecast end)."""
        lost = []
        for rid, e in self.by_id.items():
            w = self.endpoints.get(e.address)
            tpot = w.tpot if w is not None else DEFAULT_TPOT
            limit = max(LOST_AFTER_MIN, LOST_AFTER_FACTOR * e.forecast.high * tpot)
            if now - e.sent_at > limit:
                lost.append(rid)
        for rid in lost:
            self.finish(rid)
        return len(lost)


@dataclass(slots=True)
class Projection:
    """One endpoint's KV cache played forward over its requests' predicted ends.

    `free_now` is the KV (tokens) free once what is queued there and fits now is admitted;
    `free_at_end[k]` the same right after the k-th predicted end, `end_steps[k]` decode steps
    from now. From end `first` on, every request queued there now has been admitted (-1: all at
    once), so a new request behind them may take what is free."""
    free_now: float
    end_steps: list[float]
    free_at_end: list[float]
    first: int
    tpot: float                 # seconds per decode step (the endpoint's time per output token)
    token_ratio: float = 1.0    # engine tokens per token the picker counts

    def wait_steps(self, need: float) -> float:
        """Decode steps until a new request, behind the queue, finds `need` KV tokens free
        (after the last predicted end at most)."""
        if self.first < 0 and self.free_now >= need:
            return 0.0
        free_at = self.free_at_end
        for k in range(max(0, self.first), len(free_at)):
            if free_at[k] >= need:
                return self.end_steps[k]
        return self.end_steps[-1] if self.end_steps else 0.0

    def wait_seconds(self, need: float) -> float:
        return self.wait_steps(need) * self.tpot


class LazyProjection:
    """A projection made only when a question needs it: an endpoint with nothing queued and the
    KV free for the request answers at once (most of a pool with room), without walking its
    requests' ends (project() below)."""

    __slots__ = ("args", "free_now", "queued", "token_ratio", "_made")

    def __init__(self, args: tuple, free_now: float, queued: bool, token_ratio: float):
        self.args, self.free_now, self.queued = args, free_now, queued
        self.token_ratio = token_ratio
        self._made: Projection | None = None

    def _projection(self) -> Projection:
        if self._made is None:
            self._made = _project(*self.args)
        return self._made

    def wait_steps(self, need: float) -> float:
        if not self.queued and self.free_now >= need:
            return 0.0
        return self._projection().wait_steps(need)

    def wait_seconds(self, need: float) -> float:
        if not self.queued and self.free_now >= need:
            return 0.0
        return self._projection().wait_seconds(need)


def project(work: EndpointWork, now: float, capacity: float, used: float, running: float,
            waiting: float, avg_prompt: float, fallback: Forecast | None,
            token_ratio: float = 1.0) -> LazyProjection:
    """The projection (made when first needed) from the endpoint's last scrape (`used` KV
    tokens, `running` and `waiting` requests) and this picker's entries there: see _project."""
    args = (work, now, capacity, used, running, waiting, avg_prompt, fallback, token_ratio)
    return LazyProjection(args, max(0.0, capacity - used), waiting >= 1, token_ratio)


def _project(work: EndpointWork, now: float, capacity: float, used: float, running: float,
             waiting: float, avg_prompt: float, fallback: Forecast | None,
             token_ratio: float = 1.0) -> Projection:
    """The projection from the endpoint's last scrape (`used` KV tokens, `running` and `waiting`
    requests) and this picker's entries there. The newest `waiting` entries are still queued;
    of the others, the `running` likeliest still to run are (the rest have ended and their
    outcomes are on their way: the access log flushes once a second). What they have produced
    is the time-based estimate calibrated on the KV the scrape says they hold. Requests the
    picker did not send (another gateway, a lost entry) get the pool's forecast and an equal
    share of the KV the picker cannot account for."""
    entries = sorted(work.entries.values(), key=_sent_at)
    n_wait = min(len(entries), int(waiting))
    queued = entries[len(entries) - n_wait:] if n_wait else []
    tpot, ttft = work.tpot, work.ttft
    started = []
    for e in entries[:len(entries) - n_wait]:       # work.produced, inlined: the hot loop
        since = e.started_at if e.started_at is not None else e.sent_at + ttft
        started.append((e, max(0.0, (now - since) / tpot - e.prompt_tokens / PREFILL_CHUNK)))
    if len(started) > running:
        started.sort(key=lambda ep: ep[0].forecast.survival(ep[1]), reverse=True)
        started = started[:int(running)]
    prompts = sum(e.prompt_tokens for e, _ in started)
    made = sum(produced for _, produced in started)
    if made > 0 and used > prompts:
        k = min(MAX_CALIBRATION, max(1.0 / MAX_CALIBRATION, (used - prompts) / made))
        started = [(e, produced * k) for e, produced in started]
    ends: list[list[float]] = []        # [steps until it ends, tokens it holds now]
    held = 0.0
    for e, produced in started:
        kv = e.prompt_tokens + produced
        held += kv
        ends.append([e.forecast.residual(produced), kv])
    unknown = int(running) - len(started)
    if unknown > 0 and fallback is not None:
        share = max(0.0, used - held) / unknown
        ends.extend([fallback.median, share] for _ in range(unknown))
        held = max(held, used)
    if held > 0 and used > 0:       # what each holds adds up to what the scrape says is held
        scale = used / held
        for end in ends:
            end[1] *= scale
    queue = [(e.prompt_tokens, e.forecast.median) for e in queued]
    extra = int(waiting) - n_wait
    if extra > 0:
        length = fallback.median if fallback is not None else 0.0
        queue.extend((avg_prompt * token_ratio, length) for _ in range(extra))
    p = _play(ends, queue, max(0.0, capacity - used), work.tpot, WATERMARK * capacity)
    p.token_ratio = token_ratio
    return p


def _sent_at(e: RunningEntry) -> float:
    return e.sent_at


def _play(ends: list[list[float]], queue: list[tuple[float, float]], free: float,
          tpot: float, watermark: float = 0.0) -> Projection:
    """Walk the predicted ends in order, as vLLM's scheduler would: a queued request is admitted
    once its prompt fits above the watermark (its answer then ends after its prefill and its
    forecast length); every running request takes a token per step; when the free KV runs out
    before the next end, the newest running request is preempted (it frees what it holds and
    goes back to the head of the queue, to recompute it all, after the next end)."""
    # Running requests in admission order: [ends at step, held at `since`, since, alive].
    runs = [[left, kv, 0.0, True] for left, kv in sorted(ends, key=lambda e: -e[0])]
    heap = [(r[0], i) for i, r in enumerate(runs)]
    heapq.heapify(heap)
    queue = list(queue)
    free_now = None
    step, alive, head, newest = 0.0, len(runs), 0, len(runs) - 1
    end_steps: list[float] = []
    free_at_end: list[float] = []
    first = None
    preempted = False
    while True:
        while not preempted and head < len(queue) and free - queue[head][0] >= watermark:
            prompt, length = queue[head]
            free -= prompt
            head += 1
            ends_at = step + prompt / PREFILL_CHUNK + length
            runs.append([ends_at, prompt, step, True])
            heapq.heappush(heap, (ends_at, len(runs) - 1))
            alive += 1
            newest = len(runs) - 1
        if end_steps:
            free_at_end[-1] = free       # after the end and what it let in
        else:
            free_now = free
        if first is None and head == len(queue):
            first = len(end_steps) - 1
        while heap and not runs[heap[0][1]][3]:
            heapq.heappop(heap)
        if not heap or len(end_steps) >= MAX_ENDS:
            break
        at = heap[0][0]
        if alive and free - alive * (at - step) < 0:
            step += max(0.0, free) / alive
            free = 0.0
            while not runs[newest][3]:
                newest -= 1
            victim = runs[newest]
            victim[3] = False
            alive -= 1
            kv = victim[1] + (step - victim[2])
            free += kv
            queue.insert(head, (kv, max(1.0, victim[0] - step)))
            preempted = True
            continue
        _, i = heapq.heappop(heap)
        ended = runs[i]
        ended[3] = False
        free -= alive * (at - step)
        step = at
        free += ended[1] + (step - ended[2])
        alive -= 1
        preempted = False
        end_steps.append(step)
        free_at_end.append(free)
    if first is None:
        first = len(end_steps)
    return Projection(free_now, end_steps, free_at_end, first, tpot)

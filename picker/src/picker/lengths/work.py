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
MAX_ENDS = 256              # a projection looks this many predicted ends ahead at most
WATERMARK = 0.01            # KV share an engine keeps free when admitting (vLLM's default)
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


class WorkTracker:
    """The requests in flight per endpoint, with their forecasts, and each endpoint's timings."""

    def __init__(self):
        self.endpoints: dict[str, EndpointWork] = {}
        self.by_id: dict[str, RunningEntry] = {}
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
        entries = self.work(address).entries
        entries[request_id] = entry
        if len(entries) > MAX_ENTRIES:     # outcomes lost on a grand scale: forget the oldest
            self.finish(next(iter(entries)))

    def finish(self, request_id: str) -> RunningEntry | None:
        entry = self.by_id.pop(request_id, None)
        if entry is not None:
            w = self.endpoints.get(entry.address)
            if w is not None:
                w.entries.pop(request_id, None)
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
        if tpot is not None and tpot > 0:
            w.tpot += a * (tpot - w.tpot)
        if first is not None:
            w.ttft += a * (first - w.ttft)
        w.timed += 1

    def forget(self, address: str) -> None:
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

    `free_at_end[k]` is the KV (tokens) free right after the k-th predicted end, at
    `end_steps[k]` decode steps from now, once every request waiting there now has been
    admitted (from `first` on; before it, the queue still holds some). Between ends the running
    requests each take a token per step (`running_after[k]` of them after end k)."""
    free_now: float
    end_steps: list[float]
    free_at_end: list[float]
    running_after: list[int]
    prefill_before: list[float]  # prompt tokens prefilled (admissions) before each end
    first: int                  # the first end after which the queue ahead has been admitted
    remaining_tokens: float     # output tokens the requests there still produce (forecasts)
    tpot: float
    queued_prefill: float = 0.0  # prompt tokens of the whole queue ahead
    token_ratio: float = 1.0     # engine tokens per token the picker counts

    def _end(self, need: float) -> int:
        """The index of the end after which a new request behind the queue finds `need` KV
        tokens free (-1: at once)."""
        if self.first == 0 and self.free_now >= need:
            return -1
        free_at = self.free_at_end
        for k in range(max(0, self.first - 1), len(free_at)):
            if free_at[k] >= need:
                return k
        return len(free_at) - 1

    def wait_steps(self, need: float) -> float:
        """Decode steps until a new request, behind the queue, finds `need` KV tokens free."""
        k = self._end(need)
        return self.end_steps[k] if k >= 0 else 0.0

    def wait_seconds(self, need: float, prefill_seconds: float) -> float:
        """Seconds until then: the decode steps, and the prefill of the requests admitted
        meanwhile (every admission's prompt holds up the engine's steps), at `prefill_seconds`
        per prompt token."""
        k = self._end(need)
        if k < 0:
            return self.queued_prefill * prefill_seconds
        prefill = max(self.prefill_before[k], self.queued_prefill)
        return self.end_steps[k] * self.tpot + prefill * prefill_seconds


def project(work: EndpointWork, now: float, capacity: float, used: float, running: float,
            waiting: float, avg_prompt: float, fallback: Forecast | None,
            token_ratio: float = 1.0) -> Projection:
    """The projection from the endpoint's last scrape (`used` KV tokens, `running` and `waiting`
    requests) and this picker's entries there, as vLLM schedules: the newest `waiting` entries
    are still queued and are admitted in order, each once KV for its prompt is free; every
    running request takes a token per step and frees all it holds when it ends. Running
    requests the picker did not send (another gateway, a lost entry) get the pool's forecast and
    an equal share of the KV the picker cannot account for."""
    entries = sorted(work.entries.values(), key=lambda e: e.sent_at)
    n_wait = min(len(entries), int(waiting))
    queued = entries[len(entries) - n_wait:] if n_wait else []
    started = entries[:len(entries) - n_wait]
    ends: list[list[float]] = []        # [steps until it ends, tokens it holds now]
    kv_known = 0.0
    for e in started:
        produced = work.produced(e, now)
        kv = e.prompt_tokens + produced
        kv_known += kv
        ends.append([e.forecast.residual(produced), kv])
    unknown = int(running) - len(started)
    if unknown > 0 and fallback is not None:
        share = max(0.0, used - kv_known) / unknown
        ends.extend([fallback.mean, share] for _ in range(unknown))
        kv_known = max(kv_known, used)
    if kv_known > 0 and used > 0:
        # The estimates of what each request holds add up to what the scrape says is held.
        scale = used / kv_known
        for end in ends:
            end[1] *= scale
    queue = [(float(e.prompt_tokens), e.forecast.mean) for e in queued]
    extra = int(waiting) - n_wait
    if extra > 0:
        mean = fallback.mean if fallback is not None else 0.0
        queue.extend((avg_prompt * token_ratio, mean) for _ in range(extra))
    p = _play(ends, queue, max(0.0, capacity - used), work.tpot, WATERMARK * capacity)
    p.token_ratio = token_ratio
    return p


def _play(ends: list[list[float]], queue: list[tuple[float, float]], free: float,
          tpot: float, watermark: float = 0.0) -> Projection:
    """Walk the predicted ends in order, admitting the queue as KV frees (see project).

    Like vLLM's scheduler: a queued request is admitted once its prompt fits above the
    watermark; every running request takes a token per step; when the free KV runs out before
    the next end, the newest running request is preempted (it frees what it holds and goes back
    to the head of the queue, to recompute all it had)."""
    # Running requests in admission order: [ends at step, held at `since`, since, alive].
    runs = [[left, held, 0.0, True] for left, held in sorted(ends, key=lambda e: -e[0])]
    heap = [(r[0], i) for i, r in enumerate(runs)]
    heapq.heapify(heap)
    queue = list(queue)
    remaining = sum(left for left, _ in ends)
    free_now = free
    step, alive, head = 0.0, len(runs), 0
    end_steps: list[float] = []
    free_at_end: list[float] = []
    running_after: list[int] = []
    prefill_before: list[float] = []
    prefilled = 0.0
    queued_prefill = sum(prompt for prompt, _ in queue)
    first = 0 if not queue else -1
    newest = len(runs) - 1
    preempted = False            # the queue waits for the next end after a preemption
    while len(end_steps) < MAX_ENDS:
        while not preempted and head < len(queue) and free - queue[head][0] >= watermark:
            prompt, length = queue[head]
            free -= prompt
            prefilled += prompt
            head += 1
            ends_at = step + prompt / PREFILL_CHUNK + length
            runs.append([ends_at, prompt, step, True])
            heapq.heappush(heap, (ends_at, len(runs) - 1))
            remaining += length
            alive += 1
            newest = len(runs) - 1
        if first < 0 and head == len(queue):
            first = len(end_steps)
        while heap and not runs[heap[0][1]][3]:
            heapq.heappop(heap)
        if not heap:
            break
        at = heap[0][0]
        if alive and free - alive * (at - step) < 0:
            # The KV runs out first: preempt the newest running request.
            step += max(0.0, free) / alive
            free = 0.0
            while not runs[newest][3]:
                newest -= 1
            victim = runs[newest]
            victim[3] = False
            alive -= 1
            held = victim[1] + max(0.0, step - victim[2])
            free += held
            queue.insert(head, (held, max(1.0, victim[0] - step)))
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
        running_after.append(alive)
        prefill_before.append(prefilled)
    if first < 0:
        first = len(end_steps)
    return Projection(free_now, end_steps, free_at_end, running_after, prefill_before, first,
                      remaining, tpot, queued_prefill)

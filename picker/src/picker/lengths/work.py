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

from dataclasses import dataclass, field

from picker.lengths.predictor import Forecast

# Before an endpoint's first outcome: the engine's time per output token and to first token
# (seconds; the A10 QwQ-32B deployment's order of magnitude, BENCHMARKS.md).
DEFAULT_TPOT = 0.12
DEFAULT_TTFT = 1.0
TIMING_ALPHA = 0.1          # EWMA weight of a new outcome's timings
PREFILL_CHUNK = 2048        # prompt tokens an engine prefills per step (vLLM's default budget)
LOST_AFTER_FACTOR = 4.0     # an entry older than this x its forecast's high quantile x TPOT ...
LOST_AFTER_MIN = 60.0       # ... and this many seconds has lost its outcome


@dataclass(slots=True)
class RunningEntry:
    address: str
    sent_at: float
    prompt_tokens: int       # its prompt's tokens not cached on the endpoint (what it claimed)
    forecast: Forecast
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

    def work(self, address: str) -> EndpointWork:
        w = self.endpoints.get(address)
        if w is None:
            w = self.endpoints[address] = EndpointWork()
        return w

    def add(self, request_id: str, address: str, sent_at: float, prompt_tokens: int,
            forecast: Forecast) -> None:
        entry = RunningEntry(address, sent_at, prompt_tokens, forecast)
        self.by_id[request_id] = entry
        self.work(address).entries[request_id] = entry

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
    """One endpoint's KV over the predicted ends of its running requests (tokens and steps)."""
    free_now: float                     # KV tokens free now
    ends: list[tuple[float, float]]     # (steps until it ends, KV tokens it holds now), ascending
    alive_after: list[int]              # running requests left after each end
    waiting_tokens: float               # prompt tokens of the requests waiting ahead
    remaining_tokens: float             # output tokens the running requests still produce
    tpot: float

    def wait_steps(self, need: float) -> float:
        """Decode steps until `need` KV tokens (beyond the requests waiting ahead) are free."""
        need += self.waiting_tokens
        if self.free_now >= need:
            return 0.0
        freed = 0.0
        for (steps, kv), alive in zip(self.ends, self.alive_after):
            # At this end the requests ended so far are free again (what they held now and the
            # tokens they added since, which came out of the free KV meanwhile: net, what they
            # hold now), and every request still running has taken `steps` more tokens.
            freed += kv
            if self.free_now + freed - alive * steps >= need:
                return steps
        return self.ends[-1][0] if self.ends else 0.0

    def wait_seconds(self, need: float) -> float:
        return self.wait_steps(need) * self.tpot


def project(work: EndpointWork, now: float, capacity: float, used: float, running: float,
            waiting: float, avg_prompt: float, fallback: Forecast | None) -> Projection:
    """The projection from the endpoint's last scrape (`used` KV tokens, `running` and `waiting`
    requests) and this picker's entries there. The newest `waiting` entries are the ones still
    waiting; running requests the picker did not send (another gateway, a lost entry) get the
    pool's forecast and an equal share of the KV the picker cannot account for."""
    entries = sorted(work.entries.values(), key=lambda e: e.sent_at)
    n_wait = min(len(entries), int(waiting))
    queued = entries[len(entries) - n_wait:] if n_wait else []
    started = entries[:len(entries) - n_wait]
    ends: list[tuple[float, float]] = []
    kv_known = 0.0
    remaining = 0.0
    for e in started:
        produced = work.produced(e, now)
        left = e.forecast.residual(produced)
        kv = e.prompt_tokens + produced
        kv_known += kv
        remaining += left
        ends.append((left, kv))
    unknown = int(running) - len(started)
    if unknown > 0 and fallback is not None:
        share = max(0.0, used - kv_known) / unknown
        left = fallback.mean
        for _ in range(unknown):
            ends.append((left, share))
            remaining += left
        kv_known = max(kv_known, used)
    if kv_known > 0 and used > 0:
        # The estimates of what each request holds add up to what the scrape says is held.
        scale = used / kv_known
        ends = [(left, kv * scale) for left, kv in ends]
    ends.sort()
    alive_after = list(range(len(ends) - 1, -1, -1))
    waiting_tokens = sum(e.prompt_tokens for e in queued) + max(0.0, waiting - n_wait) * avg_prompt
    return Projection(max(0.0, capacity - used), ends, alive_after, waiting_tokens, remaining,
                      work.tpot)

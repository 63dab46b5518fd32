"""Whole experiments in virtual time: N engines, a client, a routing policy. No HTTP, no sleeping.

The engines are the simulator's `local.sim.engine.Engine` with a clock that reads the lab's
virtual time. A discrete-event loop advances that time from event to event:

- ARRIVAL: a request becomes ready to send (all at t=0 for an infinite rate, at its own time for
  a trace with arrival times); it is sent at once
  when the client's concurrency limit allows, else when a running request finishes (vLLM
  benchmark semantics: `--request-rate` gaps, then a `--max-concurrency` semaphore).
  Several clients (`LabConfig.group_concurrency`): each group of requests (`LabRequest.group`)
  is its own closed loop with its own concurrency limit and its own FIFO; a request waits only
  for a slot of its own group (and for `concurrency`, the total cap, if set). Whether the
  policy can tell the clients apart is the requests' `client` (the `x-client-id` header).
- send: the policy picks an endpoint; the request is added to that engine; an idle engine
  starts a step at once, with only the requests it holds at that moment. Requests sent later,
  even at the same virtual instant, join its next step: a real client's requests reach the
  engine one by one and vLLM (like local.sim.server) starts stepping on the first. (Deferring
  the step until every event of the instant was handled put the whole first wave of an
  infinite-rate run into each engine's first step; that synchronised the closed loop and gave
  least request a ~20 % higher mean TTFT than the HTTP stack; see bench/README.md.)
- STEP_DONE: the step's tokens are delivered to the client (one chunk per request per step, as
  the simulator streams), finished requests free their slot, the engine starts its next step,
  and then the client sends what the freed slots allow (an engine does not wait for the
  client's next request; over HTTP it arrives a round trip later).

- DOWN / UP (`LabConfig.outages`): a group fails: its in-flight requests fail (the client sees
  the connection drop), the policy stops seeing it (service discovery drops it); it comes back
  later with an empty cache and the policy sees it again.

Client metrics follow vLLM's benchmark definitions (loadtest.metrics): no network, so TTFT is
the first token's time minus the send time.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field
from collections import Counter, deque
from typing import Mapping, Optional, Sequence

import numpy as np

from local.sim.engine import Engine, block_hashes
from local.sim.engines import A10_QWQ32B, EngineModel
from lab.tokenizer import prompt_token_ids
from lab.policy_api import Deferred, LabEndpoint, LabRequest, Policy, Rejected
from loadtest.metrics import RequestSample, summarize

_ARRIVAL, _DOWN, _STEP_DONE, _UP, _WAKE = 0, 1, 2, 3, 4


@dataclass
class LabConfig:
    num_engines: int = 3
    engine_model: EngineModel = A10_QWQ32B
    concurrency: Optional[int] = 30          # None = unlimited
    request_rate: float = math.inf           # requests/s; inf = all ready at t=0
    burstiness: float = 1.0                  # gamma shape of the gaps (1 = Poisson)
    seed: int = 0                            # policy randomness and arrival times
    model_name: str = "qwq"
    kv_sample_interval: float = 1.0          # seconds between recorded KV/queue samples
    base_port: int = 8101                    # endpoint names 127.0.0.1:<base_port + i>
    engine_models: Optional[Sequence[EngineModel]] = None   # per group (heterogeneous pool)
    outages: Sequence[tuple] = ()            # (group index, down at s, back at s)
    max_tokens_cap: Optional[int] = None     # clients send this max_tokens (a cap), not the length
    # Several closed-loop clients: group -> its own concurrency limit (every request's group
    # must be listed); None: one client for all requests (`concurrency`).
    group_concurrency: Optional[Mapping[str, int]] = None

    @property
    def block_size(self) -> int:
        """The KV block size the requests are hashed with (the same for every group)."""
        return (self.engine_models or [self.engine_model])[0].block_size


@dataclass
class LabRun:
    summary: dict                            # vLLM benchmark result fields + lab meta
    samples: list                            # list[loadtest.metrics.RequestSample]
    series: dict                             # address -> {"t","kv","running","waiting"} lists
    per_endpoint: dict                       # address -> counters (requests, preemptions, ...)
    wall_s: float = 0.0                      # set by lab.experiment: the run's wall seconds
    cpu_s: float = 0.0                       # and its CPU seconds


@dataclass(eq=False)
class _Client:
    request: LabRequest
    sent: float = 0.0
    first: Optional[float] = None
    last: Optional[float] = None
    itl: list = field(default_factory=list)
    tokens: int = 0


def prepare_requests(specs: Sequence, block_size: int) -> list[LabRequest]:
    """Tokenise a workload (loadtest.workloads.PromptSpec list) once, with the tiny model's
    tokenizer (lab/tokenizer.py: one word, one token); reusable across runs."""
    out = []
    all_ids = prompt_token_ids([s.prompt for s in specs])
    for i, (s, ids) in enumerate(zip(specs, all_ids)):
        out.append(LabRequest(index=i, request_id=f"req-{i}", prompt=s.prompt, token_ids=ids,
                              hashes=block_hashes(ids, block_size), max_tokens=s.output_tokens,
                              group=getattr(s, "group", ""), arrival=getattr(s, "arrival", None),
                              client=getattr(s, "client", ""), cap=getattr(s, "cap", None),
                              extra=getattr(s, "extra", None),
                              length_class=getattr(s, "length_class", ""),
                              length_dist=getattr(s, "length_dist", None)))
    return out


class _ClientLoops:
    """Several closed-loop clients: per group, its concurrency limit, its requests in flight
    (held by the policy or running) and its FIFO of arrived requests not sent yet."""

    def __init__(self, limits: Mapping[str, int], requests: Sequence[LabRequest]):
        missing = sorted({r.group for r in requests} - set(limits))
        if missing:
            raise ValueError(f"group_concurrency has no limit for group(s) {', '.join(map(repr, missing))}")
        bad = [g for g, n in limits.items() if n < 1]
        if bad:
            raise ValueError(f"group_concurrency must be >= 1 (groups {', '.join(map(repr, bad))})")
        self.limits = dict(limits)
        self.inflight: Counter[str] = Counter()
        self.waiting: dict[str, deque[tuple[int, LabRequest]]] = {g: deque() for g in limits}
        self.order = 0                       # arrival order, across groups

    def arrived(self, req: LabRequest) -> None:
        self.waiting[req.group].append((self.order, req))
        self.order += 1

    def next_to_send(self) -> Optional[LabRequest]:
        """The earliest arrived request whose group has a free slot (it leaves the FIFO)."""
        best = None
        for group, q in self.waiting.items():
            if q and self.inflight[group] < self.limits[group] and (best is None or q[0][0] < best[0][0]):
                best = q
        return best.popleft()[1] if best is not None else None


class Lab:
    def __init__(self, requests: Sequence[LabRequest], policy: Policy, config: LabConfig):
        self.config = config
        self.policy = policy
        self.now = 0.0
        self.requests = list(requests)
        clock = lambda: self.now  # noqa: E731 - the engines' injected clock
        self.clock = clock
        engine_models = list(config.engine_models or [config.engine_model] * config.num_engines)
        if len(engine_models) != config.num_engines:
            raise ValueError(f"{len(engine_models)} engine models for {config.num_engines} engines")
        self.endpoints = [
            LabEndpoint(i, f"127.0.0.1:{config.base_port + i}", self._new_engine(engine_models[i]),
                        config.model_name)
            for i in range(config.num_engines)]
        self.rng = random.Random(config.seed)
        self.events: list = []
        self.seq = 0
        self.pending: list[LabRequest] = []      # arrived, waiting for a concurrency slot
        self.pending_head = 0
        self.inflight = 0
        self.loops = _ClientLoops(config.group_concurrency, self.requests) \
            if config.group_concurrency is not None else None
        self.clients: dict[str, _Client] = {}
        self.samples: list[RequestSample] = []
        self.series = {ep.address: {"t": [], "kv": [], "running": [], "waiting": []}
                       for ep in self.endpoints}
        self.next_sample = [0.0] * len(self.endpoints)
        self.counts = {ep.address: {"requests": 0} for ep in self.endpoints}
        self.track_history = policy.scrape_interval is not None
        self.held_since: dict[str, float] = {}   # request id -> send time, while the policy holds it
        self.wake_at: Optional[float] = None
        for r in self.requests:  # requests are shared across runs: set it either way
            r.max_tokens_cap = config.max_tokens_cap

    def _new_engine(self, engine_model: EngineModel) -> Engine:
        """An engine on the lab's clock. Not streaming: the lab reads each request's token times
        when it finishes instead of one output per token (the same times). With decode runs:
        its requests' counters lag within a stretch of decode steps until synced (_policy)."""
        return Engine(engine_model, self.clock, kv_events=self.policy.kv_events, stream=False,
                      decode_runs=True)

    def _policy(self) -> Policy:
        """The policy, to be called now: every engine's requests brought up to date first, as
        the policy may read them (the oracle copies whole engines), unless it never does."""
        if self.policy.reads_engines:
            self._sync_engines()
        return self.policy

    def _sync_engines(self) -> None:
        for ep in self.endpoints:
            ep.engine.sync()

    # ----- event plumbing ------------------------------------------------------------------

    def _push(self, t: float, kind: int, obj) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, obj))

    def _arrival_times(self) -> list[float]:
        n, rate = len(self.requests), self.config.request_rate
        if n and all(r.arrival is not None for r in self.requests):
            return [r.arrival for r in self.requests]
        if math.isinf(rate):
            return [0.0] * n
        gen = np.random.default_rng(self.config.seed)
        shape = self.config.burstiness
        gaps = gen.gamma(shape, 1.0 / (rate * shape), size=n)
        return np.cumsum(gaps).tolist()

    def _snapshot(self, ep: LabEndpoint) -> None:
        e = ep.engine
        if self.track_history:
            ep.history.append((self.now, len(e.running), len(e.waiting), e.kv_cache_usage()))
        i = ep.index
        if self.now >= self.next_sample[i]:
            s = self.series[ep.address]
            s["t"].append(self.now)
            s["kv"].append(e.kv_cache_usage())
            s["running"].append(len(e.running))
            s["waiting"].append(len(e.waiting))
            self.next_sample[i] = self.now + self.config.kv_sample_interval

    # ----- client side ---------------------------------------------------------------------

    def _can_send(self) -> bool:
        c = self.config.concurrency
        return c is None or self.inflight < c

    def _send(self, req: LabRequest) -> None:
        try:
            ep = self._policy().pick(req)
        except Deferred:
            self.held_since[req.request_id] = self.now
            self._take_slot(req)   # the client waits for it: it holds a concurrency slot
            return
        except Rejected as err:
            self._rejected(req, err, self.now)
            return
        self._dispatch(req, ep, self.now)

    def _rejected(self, req: LabRequest, err: Exception, sent: float) -> None:
        self.samples.append(RequestSample(start=sent, success=False, end=self.now,
                                          error=str(err), prompt_tokens=len(req.token_ids),
                                          group=req.group))

    def _wake(self) -> None:
        for req, outcome in self._policy().wake():
            sent = self.held_since.pop(req.request_id)
            self._free_slot(req)
            if isinstance(outcome, Rejected):
                self._rejected(req, outcome, sent)
            else:
                self._dispatch(req, outcome, sent)
        self._send_pending()

    def _arm_wake(self) -> None:
        if not self.held_since:
            return
        t = self.policy.next_wakeup()   # after every event: not synced (see Policy.next_wakeup)
        if t is not None and (self.wake_at is None or t < self.wake_at):
            self.wake_at = max(t, self.now)
            self._push(self.wake_at, _WAKE, self.wake_at)

    def _dispatch(self, req: LabRequest, ep: LabEndpoint, sent: float) -> None:
        req.endpoint = ep
        client = _Client(req, sent=sent)
        try:
            ep.engine.add_request(req.request_id, req.token_ids, req.max_tokens,
                                  hashes=req.hashes)
        except ValueError as err:
            self._policy().on_done(req, ep)
            self.samples.append(RequestSample(start=self.now, success=False, end=self.now,
                                              error=str(err), target=ep.address,
                                              prompt_tokens=len(req.token_ids), group=req.group))
            return
        self._take_slot(req)
        ep.inflight += 1
        self.counts[ep.address]["requests"] += 1
        self.clients[req.request_id] = client
        self._snapshot(ep)
        if not ep.busy:
            ep.busy = True
            self._step(ep)

    def _send_pending(self) -> None:
        if self.loops is not None:
            while self._can_send() and (req := self.loops.next_to_send()) is not None:
                self._send(req)
            return
        while self.pending_head < len(self.pending) and self._can_send():
            req = self.pending[self.pending_head]
            self.pending_head += 1
            self._send(req)

    def _take_slot(self, req: LabRequest) -> None:
        self.inflight += 1
        if self.loops is not None:
            self.loops.inflight[req.group] += 1

    def _free_slot(self, req: LabRequest) -> None:
        self.inflight -= 1
        if self.loops is not None:
            self.loops.inflight[req.group] -= 1

    def _finish(self, client: _Client, ep: LabEndpoint) -> None:
        req = client.request
        del self.clients[req.request_id]
        self._free_slot(req)
        ep.inflight -= 1
        self.samples.append(RequestSample(
            start=client.sent, success=True, ttft=client.first - client.sent,
            latency=client.last - client.sent, itl=client.itl,
            prompt_tokens=len(req.token_ids), output_tokens=client.tokens, end=client.last,
            target=ep.address, endpoint=req.path, group=req.group))
        req.sent_at, req.first_token_at, req.completion_tokens = client.sent, client.first, client.tokens
        self._policy().on_done(req, ep)

    # ----- engine side ---------------------------------------------------------------------

    def _step(self, ep: LabEndpoint) -> None:
        result = ep.engine.step()
        self._snapshot(ep)
        if result is None:
            ep.busy = False
        else:
            ep.step_end = result.end_time
            self._push(result.end_time, _STEP_DONE, (ep, result, ep.epoch))
            if self.policy.kv_events:
                self._publish(ep, result.end_time)

    def _publish(self, ep: LabEndpoint, at: float) -> None:
        """The step's KV-cache events as one batch, published when the step ends (as the
        simulator's server and vLLM publish them)."""
        events = ep.engine.take_kv_events()
        if events:
            self.policy.on_kv_events(ep, ep.kv_seq, events, at)
            ep.kv_seq += 1

    def _deliver(self, ep: LabEndpoint, result, epoch: int) -> None:
        if epoch != ep.epoch:       # a step of an engine that has failed since
            return
        clients = self.clients
        for r in result.finished:    # each token reached the client at the end of its step
            c = clients[r.request_id]
            c.first, c.last, c.itl, c.tokens = (r.first_token_time, r.last_token_time,
                                                r.token_gaps, r.num_output)
            self._finish(c, ep)
        self._step(ep)
        self._send_pending()

    def _down(self, ep: LabEndpoint) -> None:
        ep.up, ep.busy = False, False
        ep.epoch += 1
        self._policy().set_available([e for e in self.endpoints if e.up])
        for client in [c for c in self.clients.values() if c.request.endpoint is ep]:
            req = client.request
            del self.clients[req.request_id]
            self._free_slot(req)
            ep.inflight -= 1
            self.samples.append(RequestSample(
                start=client.sent, success=False, end=self.now, error="group down",
                target=ep.address, prompt_tokens=len(req.token_ids), group=req.group))
            self._policy().on_done(req, ep)
        self._send_pending()

    def _up(self, ep: LabEndpoint) -> None:
        # Restarted: an empty cache, and its event sequence starts again from 0.
        ep.engine = self._new_engine(ep.engine.engine_model)
        ep.kv_seq = 0
        ep.history.clear()
        ep.up = True
        self._policy().set_available([e for e in self.endpoints if e.up])

    # ----- main loop -----------------------------------------------------------------------

    def run(self) -> LabRun:
        self._schedule()
        events = self.events
        while events:
            t, _, kind, obj = heapq.heappop(events)
            self.now = t
            self._handle(kind, obj)
            self._arm_wake()
        return self._result()

    def _schedule(self) -> None:
        """The run's first events: the policy starts, every arrival and outage is queued."""
        self.policy.start(self.endpoints, lambda: self.now, self.rng)
        for req, t in zip(self.requests, self._arrival_times()):
            self._push(t, _ARRIVAL, req)
        for index, down_at, up_at in self.config.outages:
            self._push(down_at, _DOWN, self.endpoints[index])
            self._push(up_at, _UP, self.endpoints[index])

    def _handle(self, kind: int, obj) -> None:
        """One event at `self.now`; a subclass adds its own kinds and passes the rest here."""
        if kind == _STEP_DONE:
            self._deliver(*obj)
        elif kind == _DOWN:
            self._down(obj)
        elif kind == _UP:
            self._up(obj)
        elif kind == _WAKE:
            if obj != self.wake_at:
                return   # superseded by an earlier wake-up
            self.wake_at = None
            self._wake()
        elif kind == _ARRIVAL:
            if self.loops is not None:
                self.loops.arrived(obj)
            else:
                self.pending.append(obj)
            self._send_pending()
        else:
            raise ValueError(f"unknown lab event kind {kind}")

    def _result(self) -> LabRun:
        cfg = self.config
        self._sync_engines()     # every engine's counters up to date
        summary = summarize(
            self.samples, label=f"lab:{self.policy.name}", backend="lab",
            model_id=cfg.model_name, num_prompts=len(self.requests),
            max_concurrency=cfg.concurrency,
            **({"group_concurrency": dict(cfg.group_concurrency)} if cfg.group_concurrency else {}),
            request_rate="inf" if math.isinf(cfg.request_rate) else cfg.request_rate,
            burstiness=cfg.burstiness, seed=cfg.seed, policy=self.policy.name,
            num_engines=cfg.num_engines, engine_model=cfg.engine_model.name)
        per_endpoint = {}
        for ep in self.endpoints:
            e = ep.engine
            per_endpoint[ep.address] = dict(
                self.counts[ep.address], preemptions=e.num_preemptions,
                prefix_cache_queries=e.prefix_cache_queries,
                prefix_cache_hits=e.prefix_cache_hits, generation_tokens=e.generation_tokens)
        summary["per_endpoint"] = per_endpoint
        summary.update(self.policy.report())
        if cfg.outages:
            summary.update(outage_windows(self.samples, cfg.outages[0]))
        return LabRun(summary, self.samples, self.series, per_endpoint)


OUTAGE_WINDOWS = ("before", "during", "after")
OUTAGE_KEYS = tuple(f"mean_ttft_ms_{w}_outage" for w in OUTAGE_WINDOWS)   # summary keys, same order


def outage_windows(samples: Sequence[RequestSample], outage: tuple) -> dict:
    """Mean TTFT (ms) of the requests that succeeded, by when they were sent: before the group
    went down, while it was down, after it came back (`mean_ttft_ms_<window>_outage`)."""
    _, down, up = outage
    ttfts: dict[str, list[float]] = {w: [] for w in OUTAGE_WINDOWS}
    for s in samples:
        if s.success:
            window = "before" if s.start < down else "during" if s.start < up else "after"
            ttfts[window].append(s.ttft)
    return {key: 1000.0 * sum(v) / len(v) if v else 0.0
            for key, v in zip(OUTAGE_KEYS, ttfts.values())}


def run_lab(requests: Sequence[LabRequest], policy: Policy,
            config: Optional[LabConfig] = None) -> LabRun:
    return Lab(requests, policy, config or LabConfig()).run()

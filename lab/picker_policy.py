"""The picker as a lab policy: the picker's real Router, fed the engines' rendered /metrics.

Everything production would do, in virtual time:
- every endpoint is scraped every `scrape_interval` seconds (the picker's default,
  `picker.defaults.SCRAPE_INTERVAL`), with the endpoints' scrape phases spread over one
  interval; the page is `local.sim.metrics.render_gauges` of the engine's state at the scrape
  instant, parsed by the picker's own parser (`parse_vllm_metrics`) and given to the Router
  with `Router.on_metrics` (what `Router.on_scrape_ok` does; staleness rules). An engine state
  seen before reuses its page's parse (the parse is a pure function of the page);
- each request is decided by `Router.decide(RequestInfo(path, headers, body))` with the same JSON
  body a load-test client sends, and reported with `Router.on_request_done` when the picker
  would learn of its end: with the deployed EnvoyExtensionPolicy (request phase only) Envoy closes
  the ext_proc stream as soon as the picker has answered, so by default the lab reports the end
  right after the decision (`phases="request"`); `phases="response"` reports it when the response
  completes, as a policy that also sends the response phase would.

Scrapes are replayed lazily: before each Router call the adapter performs, per endpoint, the
latest scrape tick not yet performed, with the engine state recorded at that tick. Only the
latest scrape before a call can influence the Router (each scrape replaces the previous
signals), so this equals scraping at every tick, at a fraction of the cost.

Precise prefix routing (`precise=True`, policy names ending in `+precise`): the engines record
their KV-cache events (local.sim.engine) and publish each step's batch when the step ends, with
vLLM's sequence numbers (from 0 at every engine start); the adapter delivers each batch
`kv_delay` seconds later through `Router.on_kv_events` (the picker's tracker and precise index,
as its signals process feeds them from the wire) and gives the Router the model's tokenizer
(`Router.enable_precise`: the tiny model's, lab/tokenizer.py, which the engines' token ids come
from too). Batches are applied lazily, in delivery order, before each Router call.
`KV_EVENTS_DELAY` is the delay measured on the local stack (BENCHMARKS.md, "KV-cache events").
"""

from __future__ import annotations

import bisect
import heapq
import json
import math
import random

from picker import defaults
from picker.core import RequestInfo, Router, RouterSettings
from picker.errors import PickerError
from picker.flowcontrol.controller import FlowControl, FlowSettings
from picker.flowcontrol.queue import Held
from picker.lengths.predictor import PredictorSettings
from picker.scheduling.profile import load_profile
from picker.signals.metrics import parse_vllm_metrics
from picker.signals.outcomes import Outcome

from local.sim.engine import AllBlocksCleared, BlockRemoved, BlockStored
from local.sim.metrics import cache_config_labels, render_gauges
from lab.policy_api import Deferred, LabRequest, Policy, Rejected

PHASES = ("request", "response")
# Seconds (model time) from the end of an engine step to the picker's workers holding its events,
# as measured on the local stack (`python -m bench precise-http`, make demo at speedup 5): the
# signals process receives a batch 2.5 ms after the simulator publishes it (mean; P99 13.5 ms,
# wall) and hands index changes to the workers within its 10 ms flush interval, about 7.5 ms
# wall on average = 38 ms of model time at speedup 5, 12.5 ms wall at most = 62 ms: 50 ms.
KV_EVENTS_DELAY = 0.05
# Outcomes (what the picker learns answer lengths and timings from) come with Envoy's access log:
# its gRPC access log sink flushes its buffer every second (Envoy's default
# buffer_flush_interval), so a request's outcome reaches the picker at the next full second
# after its last byte.
OUTCOME_FLUSH = 1.0
LENGTHS_ON = PredictorSettings()     # the picker's default: output lengths learned from outcomes
TOLD = (None, "length", "distribution")


def picker_events(events: list) -> list:
    """The engine's events as the picker's decoder produces them (picker.signals.kvevents)."""
    from picker.signals import kvevents as kv
    out = []
    for e in events:
        if isinstance(e, BlockStored):
            out.append(kv.BlockStored(block_hashes=e.block_hashes,
                                      parent_block_hash=e.parent_block_hash,
                                      token_ids=e.token_ids, block_size=e.block_size))
        elif isinstance(e, BlockRemoved):
            out.append(kv.BlockRemoved(block_hashes=e.block_hashes))
        elif isinstance(e, AllBlocksCleared):
            out.append(kv.AllBlocksCleared())
    return out


class PickerPolicy(Policy):
    reads_engines = False        # only the scrapes recorded in LabEndpoint.history
    def __init__(self, profile: str = "default", scrape_interval: float | None = None,
                 staleness: float | None = None, phases: str = "request", flow: bool = False,
                 flow_settings: FlowSettings | None = None, precise: bool = False,
                 kv_delay: float | None = None, objectives: tuple = (),
                 lengths: PredictorSettings | None = LENGTHS_ON, told: str | None = None,
                 id_prefix: str = "picker-"):
        self.id_prefix = id_prefix   # request ids: distinct per replica, as the picker's are
        if phases not in PHASES:
            raise ValueError(f"phases must be one of {PHASES}, not {phases!r}")
        if told not in TOLD:
            raise ValueError(f"told must be one of {TOLD}, not {told!r}")
        self.told = told
        self.phases = phases
        self.objectives = list(objectives)   # picker.discovery.objects.Objective
        self.profile_name = profile
        self.name = "picker" if profile == "default" else f"picker:{profile}"
        if phases != "request":
            self.name += f"+{phases}"
        # flow control: the picker's own FlowControl holds what no endpoint can start now
        self.flow_settings = flow_settings or (FlowSettings() if flow else None)
        if self.flow_settings is not None:
            self.name = self.name.replace("picker", "picker-flow", 1)
        self.kv_events = precise
        self.kv_delay = KV_EVENTS_DELAY if kv_delay is None else kv_delay
        if precise:
            self.name += "+precise" if kv_delay is None else f"+precise={kv_delay:g}"
        self.profile = load_profile(profile)
        self.scrape_interval = scrape_interval or defaults.SCRAPE_INTERVAL
        self.settings = RouterSettings(lengths=lengths)
        if staleness is not None:
            self.settings.staleness = staleness
        self.scrapes = 0
        self.forecasts: list = []   # (request, Forecast) of every decided request, for accuracy

    def start(self, endpoints, clock, rng):
        super().start(endpoints, clock, rng)
        self.router = Router(self.profile, objectives=self.objectives, clock=clock,
                             rng=random.Random(rng.random()), settings=self.settings,
                             id_prefix=self.id_prefix)
        self.router.set_endpoints([ep.address for ep in endpoints])
        if self.told is not None:
            self.router.predictor = ToldPredictor(self.router.predictor, self.told)
        self.by_address = {ep.address: ep for ep in endpoints}
        self.flow = FlowControl(self.router, self.flow_settings) if self.flow_settings else None
        self.held = 0   # requests flow control held (not decided when they arrived)
        self.out: list = []   # (request, Decision | PickerError) handed out by the queue
        n, iv = len(endpoints), self.scrape_interval
        # Scraping started one interval before the first request, phases spread evenly.
        self.phase = [-iv + i * iv / n for i in range(n)]
        self.done_tick = [-math.inf] * n
        self.cache_config = [cache_config_labels(ep.engine) for ep in endpoints]
        self.pages: dict = {}            # (endpoint, running, waiting, kv) -> parsed page
        self.kv_queue: list = []         # heap of (deliver at, n, address, seq, published at, events)
        self.kv_batches = 0
        self.outcomes: list = []         # heap of (deliver at, n, Outcome)
        self.outcome_seq = 0
        if self.kv_events:
            from picker.tokenizer import load_tokenizer
            from lab.tokenizer import tokenizer_dir
            self.router.enable_precise(load_tokenizer(tokenizer_dir()))

    def on_kv_events(self, endpoint, seq, events, at):
        self.queue_kv(endpoint.address, seq, picker_events(events), at)

    def queue_kv(self, address: str, seq: int, events: list, at: float) -> None:
        heapq.heappush(self.kv_queue, (at + self.kv_delay, self.kv_batches, address, seq, at, events))
        self.kv_batches += 1

    def _apply_kv(self, now: float) -> None:
        from picker.signals.kvevents import EventBatch
        queue = self.kv_queue
        while queue and queue[0][0] <= now:
            deliver, _, address, seq, at, events = heapq.heappop(queue)
            self.router.on_kv_events(address, EventBatch(at, events), seq=seq, now=deliver)

    def _catch_up(self) -> None:
        now, iv = self.clock(), self.scrape_interval
        if self.kv_queue:
            self._apply_kv(now)
        outcomes = self.outcomes
        while outcomes and outcomes[0][0] <= now:
            self.router.on_outcome(heapq.heappop(outcomes)[2])
        for ep in self.endpoints:
            i = ep.index
            tick = self.phase[i] + math.floor((now - self.phase[i]) / iv) * iv
            if tick <= self.done_tick[i]:
                continue
            hist = ep.history
            j = bisect.bisect_right(hist, tick, key=lambda h: h[0]) - 1
            if j >= 0:
                _, running, waiting, kv = hist[j]
                del hist[:j]
            else:
                running, waiting, kv = 0, 0, 0.0
            key = (i, running, waiting, kv)   # per endpoint: each has its own cache config
            page = self.pages.get(key)
            if page is None:
                page = parse_vllm_metrics(render_gauges(ep.model_name, running, waiting, kv,
                                                        self.cache_config[i]))
                if len(self.pages) > 4096:
                    self.pages.clear()
                self.pages[key] = page
            self.router.on_metrics(ep.address, page, tick)
            self.done_tick[i] = tick
            self.scrapes += 1

    def set_available(self, endpoints):
        super().set_available(endpoints)
        self.router.set_endpoints([ep.address for ep in endpoints])

    def pick(self, request: LabRequest):
        self._catch_up()
        if self.told is not None:
            self.router.predictor.request = request
        body = json.dumps(request.body(self.endpoints[0].model_name)).encode()
        info = RequestInfo(request.path, request.headers(), body)
        try:
            if self.flow is not None:
                decision = self.flow.submit(info, lambda o: self.out.append((request, o)))
                if isinstance(decision, Held):
                    self.held += 1
                    raise Deferred()
            else:
                decision = self.router.decide(info)
        except PickerError as err:
            raise Rejected(getattr(err, "status", 500), str(err)) from err
        return self._bound(request, decision)

    def _bound(self, request: LabRequest, decision):
        request.router_id = decision.request_id
        request.features = decision.features
        if decision.forecast is not None:
            self.forecasts.append((request, decision.forecast))
        if self.phases == "request":  # Envoy closes the stream once the request phase is answered
            self.router.on_request_done(decision.request_id)
        return self.by_address[decision.endpoint]

    def next_wakeup(self):
        """The next scrape tick of any endpoint (new signals), or the queue's next age bound."""
        if self.flow is None or not (len(self.flow.queue) or self.out):
            return None
        now, iv = self.clock(), self.scrape_interval
        if self.out:
            return now
        first = math.inf              # (called after every lab event while requests wait)
        for phase, done in zip(self.phase, self.done_tick):
            tick = phase + (math.floor((now - phase) / iv) + 1) * iv
            bound = (now if now > done else done) + 1e-9
            while tick <= bound:      # float rounding: always a tick still to come
                tick += iv
            if tick < first:
                first = tick
        deadline = self.flow.next_deadline()
        return first if deadline is None or first <= deadline else deadline

    def wake(self):
        self._catch_up()
        self.flow.pump()
        out, self.out = self.out, []
        return [(r, Rejected(o.status, str(o)) if isinstance(o, PickerError) else self._bound(r, o))
                for r, o in out]

    def on_done(self, request, endpoint):
        self._catch_up()
        if self.phases == "response" and request.router_id is not None:
            self.router.on_request_done(request.router_id)
        if request.router_id is not None and request.first_token_at is not None:
            self._queue_outcome(request, endpoint)

    def report(self) -> dict:
        return forecast_accuracy([(f, r.max_tokens) for r, f in self.forecasts])

    def _queue_outcome(self, request: LabRequest, endpoint) -> None:
        """The request's access-log entry, delivered at the next flush of Envoy's buffer."""
        now = self.clock()
        deliver = math.floor(now / OUTCOME_FLUSH + 1.0) * OUTCOME_FLUSH
        outcome = Outcome(request.router_id, endpoint.address, 200, len(request.token_ids),
                          request.completion_tokens, request.first_token_at - request.sent_at,
                          now - request.sent_at, request.client, self.endpoints[0].model_name,
                          getattr(request, "features", ""), deliver)
        self.outcome_seq += 1
        heapq.heappush(self.outcomes, (deliver, self.outcome_seq, outcome))


LEARNED_AFTER = 50     # accuracy "once learned": the forecasts made after this many decisions


def forecast_accuracy(pairs: list) -> dict:
    """The predictor's accuracy over (forecast, true length) pairs in decision order: the median
    absolute error of the median forecast (tokens, and relative to the true length), and how
    often the true length stayed at or below the forecast's 0.9 quantile; the same over the
    forecasts made once LEARNED_AFTER requests had been decided."""
    if not pairs:
        return {}
    out = {}
    for suffix, part in (("", pairs), ("_learned", pairs[LEARNED_AFTER:])):
        if not part:
            continue
        errors = sorted(abs(f.median - n) for f, n in part)
        relative = sorted(abs(f.median - n) / n for f, n in part)
        out[f"length_abs_error_median{suffix}"] = errors[len(errors) // 2]
        out[f"length_rel_error_median{suffix}"] = relative[len(relative) // 2]
        out[f"length_p90_coverage{suffix}"] = sum(n <= f.high for f, n in part) / len(part)
    return out


class ToldPredictor:
    """For the lab's analysis only (policies `picker-told-lengths`, `picker-told-distributions`):
    the picker told each request's true length, or its class's length distribution, instead of
    its learned forecast; everything else (learning, the projection, timings) as deployed. The
    gap between these and the learner is what learning costs; between them and the oracles, what
    the picker's view of the engines costs."""

    def __init__(self, learner, told: str):
        self.learner, self.told = learner, told
        self.request: LabRequest | None = None     # set before each decision

    def forecast(self, features):
        from loadtest import lengths
        from picker.lengths.predictor import LEVELS, Forecast
        r = self.request
        if self.told == "length" or r.length_dist is None:
            return Forecast((float(r.max_tokens),) * len(LEVELS), "told", 1.0)
        grid = lengths.quantiles(r.length_dist)
        step = len(grid) / len(LEVELS)
        return Forecast(tuple(grid[int((i + 0.5) * step)] for i in range(len(LEVELS))), "told", 1.0)

    def __getattr__(self, name):        # learn, prior, learned, ...: the learner's
        return getattr(self.learner, name)

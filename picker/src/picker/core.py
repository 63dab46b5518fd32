"""The Router: the synchronous, clock-injected core every driver shares.

The gRPC server, the scraper and discovery (and the routing lab, in virtual time) all call the
same methods; nothing here does I/O or touches asyncio. Data flows one way: endpoint/object
updates and scrapes are stored, decide() reads them and asks scheduling for a pick.

Why one file of this size: the Router is the one facade every driver and the lab call, and its
methods are short hand-offs to scheduling/, signals/ and flowcontrol/; splitting the class would
spread one request pipeline (rewrite -> objective -> admission -> candidates -> pick) over files.
"""
from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from picker import defaults
from picker.discovery.objects import Objective, Rewrite
from picker.errors import PickerError, clip
from picker.lengths.features import Features
from picker.lengths.predictor import Forecast, LengthPredictor, PredictorSettings
from picker.lengths.work import WorkTracker, project
from picker.openai import parse_body, rewrite_model
from picker.scheduling.context import SchedulingContext
from picker.scheduling.prefilter import LeastLoaded, prefilter
from picker.scheduling.precise import PrecisePrefix
from picker.scheduling.prefix import PrefixIndex, block_hashes
from picker.scheduling.profile import Profile, schedule
from picker.scheduling.rewrite import choose_target, find_rule, order_rewrites
from picker.scheduling.saturation import pool_saturation
from picker.signals.metrics import MetricsParseError, ModelServerMetrics, parse_vllm_metrics
from picker.signals.outcomes import Outcome
from picker.signals.state import (ZERO_LOAD, EndpointState, InflightEntry, Load, PeerSync,
                                  add_inflight, end_inflight, own_load, record_scrape,
                                  set_peer_load)

__all__ = ["Router", "RouterSettings", "RequestInfo", "Decision", "PickerError"]

OBJECTIVE_HEADER = "x-gateway-inference-objective"
PROJECTION_TTL = 0.1   # seconds a projection is reused while nothing else changes (~a decode step)
REQUEST_ID_HEADER = "x-request-id"
UNKNOWN_LABEL = "unknown"  # metric label of every model name neither configured nor served


@dataclass(slots=True)
class RouterSettings:
    staleness: float = defaults.STALENESS          # older metrics count as unknown-and-saturated
    inflight_timeout: float = defaults.INFLIGHT_TIMEOUT  # reap() drops older in-flight entries
    max_body_bytes: int = defaults.MAX_BODY_BYTES
    default_objective: str | None = None
    avg_prompt_alpha: float = defaults.AVG_PROMPT_ALPHA
    timeouts_to_unready: int = defaults.SCRAPE_FAILURES_TO_UNREADY  # see on_scrape_failed
    # Output lengths learned from outcomes (picker.lengths); None: no forecasts, no learning.
    lengths: PredictorSettings | None = field(default_factory=PredictorSettings)


@dataclass(slots=True)
class RequestInfo:
    path: str
    headers: dict[str, str]           # lower-case keys
    body: bytes | None
    subset: list[str] | None = None   # subset hint from the proxy, if any
    # What decide() derives from the body alone, kept for the next decision of the same request
    # (flow control decides a held request again whenever the signals change): the parsed body,
    # and the prefix hashes with the (model, block size, blocks) they were made for.
    parsed: Any = field(default=None, repr=False, compare=False)
    prefix_hashes: tuple | None = field(default=None, repr=False, compare=False)


@dataclass(slots=True)
class Decision:
    endpoint: str
    request_id: str
    model: str
    target_model: str
    body: bytes
    objective: str | None
    priority: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    client_request_id: str = ""  # the request's x-request-id (clipped), for logs only
    features: str = ""           # what the predictor saw; comes back in the Outcome
    forecast: Forecast | None = None  # its predicted answer length (None: predictor off)


class Router:
    def __init__(self, profile: Profile, objectives: Iterable[Objective] = (),
                 rewrites: Iterable[Rewrite] = (), clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None, settings: RouterSettings | None = None,
                 metrics: Any = None, id_prefix: str = "picker-"):
        self.profile = profile
        self.clock = clock
        self.rng = rng or random.Random()
        self.settings = settings or RouterSettings()
        self.metrics = metrics  # observability.metrics.PickerMetrics or None
        self.count_scrape_errors = True  # one worker per replica counts them (workers.py)
        self.count_outcomes = True       # likewise: every worker receives every outcome
        # Request ids: id_prefix + a counter. The picker writes them into its answer and Envoy's
        # access log brings them back with the outcome; runtime.build_router makes the prefix
        # "<replica>.<worker>." so that they are unique across workers and replicas.
        self.id_prefix = id_prefix
        self.replica_prefix = id_prefix.split(".", 1)[0] + "." if "." in id_prefix else id_prefix
        if metrics is not None:
            metrics.model_label = self.metric_label
        self.endpoints: dict[str, EndpointState] = {}
        self.inflight: dict[str, InflightEntry] = {}
        self.prefix = PrefixIndex(profile.lru_capacity_per_server)
        self.avg_prompt_tokens = 0.0
        self._ids = itertools.count(1)
        # Ready endpoints per served model, rebuilt only when readiness or served models change.
        self._serving: dict[str, dict[str, EndpointState]] = {}
        self._serving_lists: dict[str, list[EndpointState]] = {}
        self._ready_list: list[EndpointState] | None = None
        self._least = LeastLoaded(profile.prefilter.least)
        self.peer_sync: PeerSync | None = None   # share_with_peers(); None: no peers
        # Flow control (picker.flowcontrol): `gate(ctx, candidates)` keeps the candidates that can
        # start the request now or raises to hold it; `on_signals()` runs after every scrape.
        self.gate: Callable[[SchedulingContext, list[EndpointState]], list[EndpointState]] | None = None
        self.on_signals: Callable[[], None] | None = None
        self.objectives: dict[str, Objective] = {}
        self.rewrites: list[Rewrite] = []
        self.configured_models: frozenset[str] = frozenset()  # rewrite sources and targets
        self.set_objects(objectives, rewrites)
        self.precise: PrecisePrefix | None = None  # precise prefix routing (enable_precise)
        # Output lengths (picker.lengths): the predictor learns from outcomes, the tracker keeps
        # each endpoint's requests in flight with their forecasts.
        lengths = self.settings.lengths
        self.predictor: LengthPredictor | None = LengthPredictor(lengths) if lengths else None
        self.work = WorkTracker()

    # ---- discovery -------------------------------------------------------------------------
    def set_endpoints(self, addresses: Iterable[str]) -> None:
        wanted = list(dict.fromkeys(addresses))
        for addr in list(self.endpoints):
            if addr not in wanted:
                del self.endpoints[addr]
                self.prefix.remove_endpoint(addr)
                if self.precise is not None:
                    self.precise.forget(addr)
                self._least.forget(addr)
                self.work.forget(addr)
                if self.metrics is not None:
                    self.metrics.forget_endpoint(addr)
        for addr in wanted:
            if addr not in self.endpoints:
                self.endpoints[addr] = EndpointState(addr)
        self._changed()

    def set_objects(self, objectives: Iterable[Objective], rewrites: Iterable[Rewrite]) -> None:
        self.objectives = {o.name: o for o in objectives}
        self.rewrites = order_rewrites(list(rewrites))
        self.configured_models = frozenset(
            name for rw in self.rewrites for rule in rw.rules
            for name in (*rule.models, *(target for target, _ in rule.targets)))

    # ---- load signals ----------------------------------------------------------------------
    def on_scrape_ok(self, address: str, metrics_text: str | bytes, now: float | None = None) -> None:
        if address not in self.endpoints:
            return
        try:
            metrics = parse_vllm_metrics(metrics_text)
        except MetricsParseError:
            self.on_scrape_failed(address, now)
            raise
        self.on_metrics(address, metrics, now)

    def on_metrics(self, address: str, metrics: ModelServerMetrics, now: float | None = None) -> None:
        """A parsed scrape (from on_scrape_ok, or from the signals process)."""
        state = self.endpoints.get(address)
        if state is None:
            return
        old = state.metrics
        was_ready = state.ready
        had_since = state.since_scrape != state.peer_since_scrape
        record_scrape(state, metrics, self.clock() if now is None else now)
        work = self.work.endpoints.get(address)
        if work is not None:
            work.on_scrape(state.scraped_at, metrics.waiting + state.since_scrape)
        self._least.observe(state)
        if self.precise is not None:
            self.precise.on_metrics(address, metrics.num_gpu_blocks, metrics.block_size,
                                    metrics.prompt_tokens_computed, state.scraped_at)
        if had_since:
            self._touched(address)
        if not was_ready or old is None or old.models != metrics.models \
                or old.lora_running != metrics.lora_running or old.lora_waiting != metrics.lora_waiting:
            self._changed()
        if self.on_signals is not None:
            self.on_signals()

    def on_scrape_failed(self, address: str, now: float | None = None, timed_out: bool = False) -> None:
        """A refused connection, an error status or a bad page takes the endpoint out at once;
        a timed-out scrape only after `timeouts_to_unready` in a row (a slow scrape is not a
        dead endpoint; its metrics age meanwhile and count as saturated once stale)."""
        state = self.endpoints.get(address)
        if state is not None:
            state.scrape_errors += 1
            state.failures_in_a_row += 1
            if not timed_out or state.failures_in_a_row >= self.settings.timeouts_to_unready:
                if not state.failing:
                    state.failing = True
                    self._changed()
            if self.metrics is not None and self.count_scrape_errors:
                self.metrics.scrape_errors.labels(address).inc()

    # ---- KV-cache events: precise prefix routing (scheduling/precise.py) ----------------------
    def enable_precise(self, tokenizer, max_tokens: int | None = None) -> PrecisePrefix:
        """Route on the engines' KV-cache events with this tokenizer (picker.tokenizer; None:
        missing, every endpoint uses the approximate index)."""
        p = self.profile
        self.precise = PrecisePrefix(tokenizer, max_tokens or p.max_prefix_blocks * p.block_size_tokens)
        return self.precise

    def on_kv_events(self, address: str, events, seq: int | None = None,
                     now: float | None = None, wall_now: float | None = None) -> None:
        """One batch of an endpoint's KV-cache events, in process: an EventBatch or a list of
        events (picker.signals.kvevents). Without `seq`, every batch since the engine started
        is delivered in order; with it, gaps and restarts are handled as from the wire."""
        state = self.endpoints.get(address)
        if self.precise is None or state is None:
            return
        m = state.metrics
        self.precise.on_batch(address, events, self.clock() if now is None else now, seq, wall_now,
                              m.num_gpu_blocks if m else None, m.block_size if m else None)

    def on_kv_deltas(self, deltas, status: dict | None = None) -> None:
        """Index changes made by the signals process's subscriptions."""
        if self.precise is not None:
            self.precise.apply(deltas, status)

    # ---- peers: other workers and replicas sharing this pool's view -------------------------
    def own_loads(self) -> dict[str, Load]:
        """This process's in-flight counts per endpoint (non-zero ones)."""
        out = {}
        for addr, e in self.endpoints.items():
            if e.inflight != e.peer_inflight or e.since_scrape != e.peer_since_scrape:
                out[addr] = own_load(e)
        return out

    def share_with_peers(self, on_change: Callable[[], None] | None = None) -> PeerSync:
        """Keep what the peers need (PeerSync): this router's prefix additions and the endpoints
        whose own counts changed; on_change is called at the first change after a take."""
        self.peer_sync = PeerSync(on_change=on_change)
        return self.peer_sync

    def take_changed_loads(self) -> dict[str, Load]:
        """This process's in-flight counts of the endpoints whose counts changed since the last
        call (zeros included)."""
        sync = self.peer_sync
        if sync is None or not sync.changed:
            return {}
        out = {a: own_load(self.endpoints[a]) for a in sync.changed if a in self.endpoints}
        sync.changed.clear()
        return out

    def take_prefix_additions(self) -> list[tuple[str, list[int], int | None]]:
        """The prefix-index additions of this router's decisions since the last call."""
        sync = self.peer_sync
        if sync is None:
            return []
        adds, sync.prefix_log = sync.prefix_log, []
        return adds

    def set_peer_loads(self, loads: dict[str, Load], partial: bool = False) -> None:
        """The sum of the peers' in-flight counts per endpoint (absent = none; with partial,
        absent = unchanged)."""
        if partial:
            for addr, load in loads.items():
                e = self.endpoints.get(addr)
                if e is not None:
                    set_peer_load(e, load)
            return
        for addr, e in self.endpoints.items():
            load = loads.get(addr, ZERO_LOAD)
            if load != ZERO_LOAD or e.peer_inflight or e.peer_since_scrape:
                set_peer_load(e, load)

    def add_peer_prefixes(self, adds: Iterable[tuple[str, list[int], int | None]]) -> None:
        """Prefix-index additions made by peers (their decisions' prompts and endpoints)."""
        for address, hashes, cap_blocks in adds:
            if address in self.endpoints:
                self.prefix.add(address, hashes, cap_blocks)

    def on_models(self, address: str, names: Iterable[str]) -> None:
        """Models and LoRA adapters an endpoint lists in /v1/models (loaded, busy or idle)."""
        state = self.endpoints.get(address)
        names = frozenset(names)
        if state is not None and state.listed_models != names:
            state.listed_models = names
            self._changed()  # what the endpoint serves changed: rebuild the per-model index

    def metric_label(self, model: str) -> str:
        """A model name as a metric label: only configured or served names, else `unknown`,
        so that clients cannot create series."""
        if not model or model in self.configured_models:
            return model
        if any(e.serves(model) for e in self.endpoints.values()):
            return model
        return UNKNOWN_LABEL

    @property
    def ready(self) -> bool:
        return any(e.ready for e in self.endpoints.values())

    # ---- requests --------------------------------------------------------------------------
    def decide(self, info: RequestInfo) -> Decision:
        started = time.perf_counter()
        try:
            decision = self._decide(info)
        except PickerError as err:
            if self.metrics is not None:
                self.metrics.record_error(err, time.perf_counter() - started,
                                          self.metric_label(err.model),
                                          self.metric_label(err.target_model))
            raise
        if self.metrics is not None:
            self.metrics.record_decision(decision, time.perf_counter() - started)
        return decision

    def on_request_done(self, request_id: str, usage: dict | None = None) -> None:
        entry = self.inflight.pop(request_id, None)
        if entry is not None:
            end_inflight(entry)
            self._touched(entry.state.address)
            if usage and self.metrics is not None:
                self.metrics.record_usage(usage)

    def on_outcome(self, outcome: Outcome) -> None:
        """A request Envoy served completed (signals/outcomes.py): the endpoint, status, token
        counts and timings it had. Its entry in flight ends, the predictor learns its answer's
        length, its endpoint's timings are updated."""
        if self.metrics is not None and self.count_outcomes:
            self.metrics.record_outcome(outcome, self.metric_label(outcome.model),
                                        self._matched(outcome.request_id))
        self.work.outcomes += 1
        entry = self.work.finish(outcome.request_id)
        if outcome.status != 200 or outcome.completion_tokens is None:
            return
        if entry is not None:
            if outcome.prompt_tokens:
                self.work.learn_token_ratio(entry.counted, outcome.prompt_tokens)
            if self.metrics is not None:
                self.metrics.record_forecast_error(self.metric_label(outcome.model),
                                                   entry.forecast.family, entry.forecast.median,
                                                   outcome.completion_tokens)
        if outcome.endpoint in self.endpoints:
            self.work.learn_timings(outcome.endpoint, outcome.ttft, outcome.duration,
                                    outcome.completion_tokens)
        if self.predictor is not None and outcome.features:
            features = Features.from_key(outcome.features)
            if features is not None:
                self.predictor.learn(features, outcome.completion_tokens)

    def _matched(self, request_id: str) -> str:
        """Whose decision an outcome's request id names: "replica" (this one), "other" (another
        replica, or this one before a restart) or "none" (not decided by a picker: refused at the
        edge or by the picker itself)."""
        if not request_id:
            return "none"
        return "replica" if request_id.startswith(self.replica_prefix) else "other"

    def reap(self, now: float | None = None) -> int:
        now = self.clock() if now is None else now
        self.work.reap(now)
        limit = now - self.settings.inflight_timeout
        lost = [rid for rid, e in self.inflight.items() if e.sent_at < limit]
        for rid in lost:
            entry = self.inflight.pop(rid)
            end_inflight(entry)
            self._touched(entry.state.address)
        return len(lost)

    def pool_saturation(self) -> float:
        self._mark_stale(self.endpoints.values(), self.clock())
        return pool_saturation([e for e in self.endpoints.values() if e.ready],
                               self.profile.saturation)

    # ---- internals -------------------------------------------------------------------------
    def _mark_stale(self, eps: Iterable[EndpointState], now: float) -> None:
        oldest = now - self.settings.staleness
        for e in eps:
            e.stale = e.scraped_at is None or e.scraped_at < oldest

    def _touched(self, address: str) -> None:
        sync = self.peer_sync
        if sync is not None:
            if not sync.changed and sync.on_change is not None:
                sync.on_change()
            sync.changed.add(address)

    def _changed(self) -> None:
        self._serving.clear()
        self._serving_lists.clear()
        self._ready_list = None

    def _serving_model(self, model: str) -> tuple[list[EndpointState], dict[str, EndpointState]]:
        by_addr = self._serving.get(model)
        if by_addr is None:
            by_addr = self._serving[model] = {a: e for a, e in self.endpoints.items()
                                              if e.ready and e.serves(model)}
            self._serving_lists[model] = list(by_addr.values())
        return self._serving_lists[model], by_addr

    def _ready(self, subset: list[str] | None) -> list[EndpointState]:
        if subset is None:
            if self._ready_list is None:
                self._ready_list = [e for e in self.endpoints.values() if e.ready]
            return self._ready_list
        eps = self.endpoints
        ready = [eps[a] for a in dict.fromkeys(subset) if a in eps and eps[a].ready]
        if not ready:
            raise PickerError(503, "no ready endpoint in the subset the gateway allowed",
                              "no_endpoint_in_subset")
        return ready

    def _request_id(self) -> str:
        """In-flight entries are keyed by ids only the picker makes: a client's x-request-id can
        neither replace nor collide with another request's entry."""
        return f"{self.id_prefix}{next(self._ids)}"

    def _objective(self, headers: dict[str, str]) -> tuple[str | None, int]:
        name = headers.get(OBJECTIVE_HEADER) or self.settings.default_objective
        obj = self.objectives.get(name) if name else None
        return name, obj.priority if obj else 0

    def _decide(self, info: RequestInfo) -> Decision:
        now = self.clock()
        body = info.body
        if body and len(body) > self.settings.max_body_bytes:  # the request's own faults first
            raise PickerError(413, f"request body of {len(body)} bytes exceeds the limit of "
                                   f"{self.settings.max_body_bytes} bytes", "body_too_large")
        parsed = info.parsed
        if parsed is None and body:
            parsed = info.parsed = parse_body(body)
        ready = self._ready(info.subset)
        if not ready:
            raise PickerError(503, "no ready endpoint in the pool", "no_ready_endpoint")
        objective, priority = self._objective(info.headers)
        request_id = self._request_id()
        client_id = clip(info.headers.get(REQUEST_ID_HEADER, ""))
        if parsed is None:  # bodiless (e.g. GET /v1/models): any ready endpoint
            chosen = self.rng.choice(ready)
            self.inflight[request_id] = add_inflight(chosen, 0, now)
            self._touched(chosen.address)
            return Decision(chosen.address, request_id, "", "", b"", objective, priority,
                            client_request_id=client_id)
        model = parsed.model
        target = choose_target(find_rule(self.rewrites, model), model, self.rng) \
            if self.rewrites else model
        if info.subset is None:
            candidates, by_addr = self._serving_model(target)
        else:
            candidates = [e for e in ready if e.serves(target)]
            by_addr = None
        if not candidates:
            raise PickerError(404, f"no endpoint serves model {clip(target)!r}"
                              + (f" (rewritten from {clip(model)!r})" if target != model else ""),
                              "model_not_found", model, target)
        profile = self.profile
        if priority < 0:
            self._mark_stale(candidates, now)
        if priority < 0 and self.gate is None \
                and pool_saturation(candidates, profile.saturation) >= 1.0:  # flow control queues it
            if self.metrics is not None:
                self.metrics.shed.labels(self.metric_label(model)).inc()
            raise PickerError(429, "the pool is saturated and this request's objective is "
                                   "sheddable (negative priority)", "pool_saturated", model, target)
        precise = self.precise if profile.needs_prefix else None
        prep = None
        if precise is not None:
            m = candidates[0].metrics
            prep = precise.prepare(info.path, parsed,
                                   None if m is None or target in m.models else target, now)
        # Scheduling counts the prompt as the approximate picker does (the profile's constants are
        # tuned in those units); precise routing changes only what is believed cached.
        prompt_tokens = parsed.prompt_tokens
        ctx = SchedulingContext(target, prompt_tokens, parsed.max_tokens, priority, now,
                                profile.block_size_tokens,
                                avg_prompt_tokens=self.avg_prompt_tokens)
        if profile.needs_prefix:
            key = (target, profile.block_size_tokens, profile.max_prefix_blocks)
            if info.prefix_hashes is None or info.prefix_hashes[0] != key:
                info.prefix_hashes = (key, block_hashes(target, parsed.prompt, *key[1:]))
            ctx.hashes = info.prefix_hashes[1]
            if ctx.hashes:
                ctx.prefix_match = self.prefix.match(ctx.hashes)
            if prep is not None:
                precise.apply_to(ctx, prep)
        features = None
        if self.predictor is not None:
            features = Features.of(info.path, info.headers, parsed.obj, target, parsed.prompt,
                                   prompt_tokens, parsed.max_tokens, ctx.hashes)
            ctx.forecast = self.predictor.forecast(features)
            if self.work.outcomes:   # the outcome path works: entries end when requests do
                ctx.projection = self._projector(target, now)
        candidates = self._prefilter(candidates, by_addr, ctx)
        self._mark_stale(candidates, now)
        if self.gate is not None:
            candidates = self.gate(ctx, candidates)
        chosen = schedule(profile, ctx, candidates, self.rng)
        cached = ctx.cached_tokens(chosen.address)
        uncached = prompt_tokens - cached
        if features is not None and self.work.outcomes:
            self.work.add(request_id, chosen.address, now, uncached, prompt_tokens, ctx.forecast)
        if prep is not None:
            precise.after_decision(prep, chosen.address, now)
        if ctx.hashes:
            # The server holds as many of our blocks as its KV cache has tokens for.
            cap_tokens = chosen.metrics.kv_capacity_tokens if chosen.metrics else None
            cap_blocks = cap_tokens // profile.block_size_tokens if cap_tokens else None
            self.prefix.add(chosen.address, ctx.hashes, cap_blocks)
            if self.peer_sync is not None:
                self.peer_sync.prefix_log.append((chosen.address, ctx.hashes, cap_blocks))
        self.avg_prompt_tokens += self.settings.avg_prompt_alpha * (uncached - self.avg_prompt_tokens)
        self.inflight[request_id] = add_inflight(chosen, uncached, now)
        self._touched(chosen.address)
        out_body = body if target == model else rewrite_model(parsed, target)
        if target != model and self.metrics is not None:
            self.metrics.rewrites.labels(self.metric_label(model), target).inc()
        if prep is not None:   # reported in the tokenizer's units
            prompt_tokens, cached = precise.reported(prep, ctx, chosen.address, cached)
        return Decision(chosen.address, request_id, model, target, out_body, objective, priority,
                        prompt_tokens, cached, client_id,
                        features.key() if features is not None else "", ctx.forecast)

    def _projector(self, model: str, now: float):
        """Per endpoint, the projection of its KV over its running requests' predicted ends
        (picker.lengths.work). Kept until the endpoint's scrape, its requests or its timings
        change, or PROJECTION_TTL passes (what its requests produced meanwhile)."""
        cache = self.work.projections
        prior = None
        tick = int(now / PROJECTION_TTL)

        def projection(e: EndpointState):
            nonlocal prior
            work = self.work.work(e.address)
            key = (e.epoch, e.since_scrape, work.version, tick, model)
            hit = cache.get(e.address)
            if hit is not None and hit[0] == key:
                return hit[1]
            if prior is None:
                prior = self.predictor.prior(model)
            m = e.metrics
            cap = m.kv_capacity_tokens or 0
            p = project(work, now, cap, m.kv_usage * cap, m.running, m.waiting + e.since_scrape,
                        self.avg_prompt_tokens, prior, self.work.token_ratio)
            cache[e.address] = (key, p)
            return p
        return projection

    def _prefilter(self, candidates: list[EndpointState], by_addr: dict[str, EndpointState] | None,
                   ctx: SchedulingContext) -> list[EndpointState]:
        settings = self.profile.prefilter
        if len(candidates) <= settings.above:
            return candidates
        if by_addr is None:
            by_addr = {e.address: e for e in candidates}
        return prefilter(candidates, by_addr, ctx.owner_tokens(), self._least.members(), self.rng,
                         settings)

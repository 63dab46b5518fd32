"""The Router: the synchronous, clock-injected core every driver shares.

The gRPC server, the scraper and discovery (and the routing lab, in virtual time) all call the
same methods; nothing here does I/O or touches asyncio. Data flows one way: endpoint/object
updates and scrapes are stored, decide() reads them and asks scheduling for a pick.
"""
from __future__ import annotations

import itertools
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from picker.discovery.objects import Objective, Rewrite
from picker.errors import PickerError, clip
from picker.openai import parse_body, rewrite_model
from picker.scheduling.context import SchedulingContext
from picker.scheduling.prefix import PrefixIndex, block_hashes
from picker.scheduling.profile import Profile, schedule
from picker.scheduling.rewrite import choose_target, find_rule, order_rewrites
from picker.scheduling.saturation import pool_saturation
from picker.signals.metrics import MetricsParseError, parse_vllm_metrics
from picker.signals.state import (EndpointState, InflightEntry, add_inflight, end_inflight,
                                  record_scrape)

__all__ = ["Router", "RouterSettings", "RequestInfo", "Decision", "PickerError"]

OBJECTIVE_HEADER = "x-gateway-inference-objective"
REQUEST_ID_HEADER = "x-request-id"
UNKNOWN_LABEL = "unknown"  # metric label of every model name neither configured nor served


@dataclass(slots=True)
class RouterSettings:
    staleness: float = 1.0            # seconds; older metrics count as unknown-and-saturated
    inflight_timeout: float = 1800.0  # seconds; reap() drops in-flight entries older than this
    max_body_bytes: int = 8 * 1024 * 1024
    default_objective: str | None = None
    avg_prompt_alpha: float = 0.05    # EWMA weight of the running mean prompt size


@dataclass(slots=True)
class RequestInfo:
    path: str
    headers: dict[str, str]           # lower-case keys
    body: bytes | None
    subset: list[str] | None = None   # subset hint from the proxy, if any


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


class Router:
    def __init__(self, profile: Profile, objectives: Iterable[Objective] = (),
                 rewrites: Iterable[Rewrite] = (), clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None, settings: RouterSettings | None = None,
                 metrics: Any = None):
        self.profile = profile
        self.clock = clock
        self.rng = rng or random.Random()
        self.settings = settings or RouterSettings()
        self.metrics = metrics  # observability.metrics.PickerMetrics or None
        if metrics is not None:
            metrics.model_label = self.metric_label
        self.endpoints: dict[str, EndpointState] = {}
        self.inflight: dict[str, InflightEntry] = {}
        self.prefix = PrefixIndex(profile.lru_capacity_per_server)
        self.avg_prompt_tokens = 0.0
        self._ids = itertools.count(1)
        self.objectives: dict[str, Objective] = {}
        self.rewrites: list[Rewrite] = []
        self.configured_models: frozenset[str] = frozenset()  # rewrite sources and targets
        self.set_objects(objectives, rewrites)

    # ---- discovery -------------------------------------------------------------------------
    def set_endpoints(self, addresses: Iterable[str]) -> None:
        wanted = list(dict.fromkeys(addresses))
        for addr in list(self.endpoints):
            if addr not in wanted:
                del self.endpoints[addr]
                self.prefix.remove_endpoint(addr)
                if self.metrics is not None:
                    self.metrics.forget_endpoint(addr)
        for addr in wanted:
            if addr not in self.endpoints:
                self.endpoints[addr] = EndpointState(addr)

    def set_objects(self, objectives: Iterable[Objective], rewrites: Iterable[Rewrite]) -> None:
        self.objectives = {o.name: o for o in objectives}
        self.rewrites = order_rewrites(list(rewrites))
        self.configured_models = frozenset(
            name for rw in self.rewrites for rule in rw.rules
            for name in (*rule.models, *(target for target, _ in rule.targets)))

    # ---- load signals ----------------------------------------------------------------------
    def on_scrape_ok(self, address: str, metrics_text: str | bytes, now: float | None = None) -> None:
        state = self.endpoints.get(address)
        if state is None:
            return
        try:
            metrics = parse_vllm_metrics(metrics_text)
        except MetricsParseError:
            self.on_scrape_failed(address, now)
            raise
        record_scrape(state, metrics, self.clock() if now is None else now)

    def on_scrape_failed(self, address: str, now: float | None = None) -> None:
        state = self.endpoints.get(address)
        if state is not None:
            state.failing = True
            state.scrape_errors += 1
            if self.metrics is not None:
                self.metrics.scrape_errors.labels(address).inc()

    def on_models(self, address: str, names: Iterable[str]) -> None:
        """Models and LoRA adapters an endpoint lists in /v1/models (loaded, busy or idle)."""
        state = self.endpoints.get(address)
        if state is not None:
            state.listed_models = frozenset(names)

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
            if usage and self.metrics is not None:
                self.metrics.record_usage(usage)

    def reap(self, now: float | None = None) -> int:
        now = self.clock() if now is None else now
        limit = now - self.settings.inflight_timeout
        lost = [rid for rid, e in self.inflight.items() if e.sent_at < limit]
        for rid in lost:
            end_inflight(self.inflight.pop(rid))
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

    def _ready(self, subset: list[str] | None) -> list[EndpointState]:
        if subset is None:
            return [e for e in self.endpoints.values() if e.ready]
        eps = self.endpoints
        ready = [eps[a] for a in dict.fromkeys(subset) if a in eps and eps[a].ready]
        if not ready:
            raise PickerError(503, "no ready endpoint in the subset the gateway allowed",
                              "no_endpoint_in_subset")
        return ready

    def _request_id(self) -> str:
        """In-flight entries are keyed by ids only the picker makes: a client's x-request-id can
        neither replace nor collide with another request's entry."""
        return f"picker-{next(self._ids)}"

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
        parsed = parse_body(body) if body else None
        ready = self._ready(info.subset)
        if not ready:
            raise PickerError(503, "no ready endpoint in the pool", "no_ready_endpoint")
        objective, priority = self._objective(info.headers)
        request_id = self._request_id()
        client_id = clip(info.headers.get(REQUEST_ID_HEADER, ""))
        if parsed is None:  # bodiless (e.g. GET /v1/models): any ready endpoint
            chosen = self.rng.choice(ready)
            self.inflight[request_id] = add_inflight(chosen, 0, now)
            return Decision(chosen.address, request_id, "", "", b"", objective, priority,
                            client_request_id=client_id)
        model = parsed.model
        target = choose_target(find_rule(self.rewrites, model), model, self.rng) \
            if self.rewrites else model
        candidates = [e for e in ready if e.serves(target)]
        if not candidates:
            raise PickerError(404, f"no endpoint serves model {clip(target)!r}"
                              + (f" (rewritten from {clip(model)!r})" if target != model else ""),
                              "model_not_found", model, target)
        self._mark_stale(candidates, now)
        profile = self.profile
        if priority < 0 and pool_saturation(candidates, profile.saturation) >= 1.0:
            if self.metrics is not None:
                self.metrics.shed.labels(self.metric_label(model)).inc()
            raise PickerError(429, "the pool is saturated and this request's objective is "
                                   "sheddable (negative priority)", "pool_saturated", model, target)
        ctx = SchedulingContext(target, parsed.prompt_tokens, parsed.max_tokens, priority, now,
                                profile.block_size_tokens,
                                avg_prompt_tokens=self.avg_prompt_tokens)
        if profile.needs_prefix:
            ctx.hashes = block_hashes(target, parsed.prompt, profile.block_size_tokens,
                                      profile.max_prefix_blocks)
            if ctx.hashes:
                ctx.prefix_match = self.prefix.match(ctx.hashes)
        chosen = schedule(profile, ctx, candidates, self.rng)
        cached = ctx.cached_tokens(chosen.address)
        uncached = parsed.prompt_tokens - cached
        if ctx.hashes:
            # The server holds as many of our blocks as its KV cache has tokens for.
            cap_tokens = chosen.metrics.kv_capacity_tokens if chosen.metrics else None
            self.prefix.add(chosen.address, ctx.hashes,
                            cap_tokens // profile.block_size_tokens if cap_tokens else None)
        self.avg_prompt_tokens += self.settings.avg_prompt_alpha * (uncached - self.avg_prompt_tokens)
        self.inflight[request_id] = add_inflight(chosen, uncached, now)
        out_body = body if target == model else rewrite_model(parsed, target)
        if target != model and self.metrics is not None:
            self.metrics.rewrites.labels(self.metric_label(model), target).inc()
        return Decision(chosen.address, request_id, model, target, out_body, objective, priority,
                        parsed.prompt_tokens, cached, client_id)

"""Prometheus metrics on their own registry (so tests and the lab can make many routers).

Per-endpoint gauges and pool saturation are read from the router when Prometheus scrapes, so
the request path pays only for the counters and the latency histogram. Label values are bounded:
model labels come from the Router's metric_label (configured or served names, else `unknown`),
endpoint labels from the current endpoint set (a removed endpoint's series are dropped).
"""
from __future__ import annotations

import math

from typing import TYPE_CHECKING, Any, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from picker.core import Decision, PickerError, Router
    from picker.signals.outcomes import Outcome

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
_TOKEN_BUCKETS = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
_TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)
_LAG_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.0, 5.0, 10.0, 30.0)
_LOG2_ERROR_BUCKETS = (0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0)   # 1.07x .. 16x off
_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0)


class PickerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("picker_requests", "Requests by model, target model and outcome code",
                                ["model", "target_model", "code"], registry=r)
        self.decision_latency = Histogram("picker_decision_duration_seconds",
                                          "Time to decide one request (parse, rewrite, schedule)",
                                          buckets=_LATENCY_BUCKETS, registry=r)
        self.shed = Counter("picker_shed_requests", "Sheddable requests refused with 429",
                            ["model"], registry=r)
        self.rewrites = Counter("picker_model_rewrites", "Model rewrites applied",
                                ["model", "target_model"], registry=r)
        self.scrape_errors = Counter("picker_scrape_errors", "Failed /metrics scrapes",
                                     ["endpoint"], registry=r)
        self.usage_tokens = Counter("picker_usage_tokens", "Tokens reported in response usage",
                                    ["kind"], registry=r)
        self.refusals = Counter("picker_refused_requests",
                                "Requests refused because the replica's stream or body budget "
                                "was full", ["code"], registry=r)
        # flow control (picker.flowcontrol); priority labels are objective priorities (bounded)
        self.flow_held = Counter("picker_flow_held_requests",
                                 "Requests the picker held because no endpoint could start them",
                                 ["priority"], registry=r)
        # livesum: with several worker processes, /metrics shows the sum of their queues
        self.flow_queued = Gauge("picker_flow_queued_requests",
                                 "Requests held in the picker's queue now, per priority",
                                 ["priority"], registry=r, multiprocess_mode="livesum")
        self.flow_wait = Histogram("picker_flow_queue_wait_seconds",
                                   "Time a held request waited in the picker before dispatch",
                                   buckets=_WAIT_BUCKETS, registry=r)
        self.flow_evictions = Counter("picker_flow_evictions",
                                      "Held requests that left the queue without dispatch, by reason "
                                      "(expired, evicted, queue_full, cancelled, error)",
                                      ["reason", "priority"], registry=r)
        # outcomes (signals/outcomes.py: Envoy's access log of every request the picker routed)
        self.outcomes = Counter("picker_outcomes", "Completed requests reported by the gateway, by "
                                "the model they were routed for, HTTP status, and whose decision "
                                "their request id names (replica: this one; other: another "
                                "replica or this one before a restart; none: no picker decided)",
                                ["model", "status", "decision"], registry=r)
        self.outcome_completion = Histogram("picker_outcome_completion_tokens",
                                            "Completion tokens of completed requests (their usage)",
                                            ["model"], buckets=_TOKEN_BUCKETS, registry=r)
        self.outcome_ttft = Histogram("picker_outcome_ttft_seconds",
                                      "Time from a streamed request's start at the gateway to its "
                                      "first token", ["model"], buckets=_TTFT_BUCKETS, registry=r)
        self.outcome_lag = Histogram("picker_outcome_lag_seconds",
                                     "Time from a response's end at the gateway to its outcome "
                                     "here (Envoy's access log buffer, mostly)",
                                     buckets=_LAG_BUCKETS, registry=r)
        # output lengths (picker.lengths): how far the forecasts of this process's decisions were
        self.forecast_error = Histogram("picker_length_forecast_error_log2",
                                        "|log2(forecast median / completion tokens)| of the requests "
                                        "this process decided, when their outcome arrives (1 = a "
                                        "factor of 2), by the feature family the forecast came from",
                                        ["model", "family"], buckets=_LOG2_ERROR_BUCKETS, registry=r)
        # model name -> label value; the Router installs its own (configured or served names)
        self.model_label: Callable[[str], str] = lambda model: model

    def record_decision(self, d: "Decision", seconds: float) -> None:
        self.decision_latency.observe(seconds)
        # the target is served by the chosen endpoint; the client's name may be anything a
        # catch-all rewrite rule accepted
        model = d.model if d.model == d.target_model else self.model_label(d.model)
        self.requests.labels(model, d.target_model, "200").inc()

    def record_error(self, err: "PickerError", seconds: float, model: str = "",
                     target: str = "") -> None:
        self.decision_latency.observe(seconds)
        self.requests.labels(model, target, str(err.status)).inc()

    def record_outcome(self, o: "Outcome", model: str, decision: str) -> None:
        self.outcomes.labels(model, str(o.status), decision).inc()
        if o.completion_tokens is not None:
            self.outcome_completion.labels(model).observe(o.completion_tokens)
        if o.ttft is not None:
            self.outcome_ttft.labels(model).observe(o.ttft)
        self.outcome_lag.observe(o.lag)

    def record_forecast_error(self, model: str, family: str, forecast: float, tokens: int) -> None:
        self.forecast_error.labels(model, family).observe(
            abs(math.log2(max(1.0, forecast)) - math.log2(max(1, tokens))))

    def forget_endpoint(self, address: str) -> None:
        try:
            self.scrape_errors.remove(address)
        except KeyError:
            pass

    def record_usage(self, usage: dict[str, Any]) -> None:
        for kind in ("prompt_tokens", "completion_tokens"):
            value = usage.get(kind)
            if isinstance(value, int) and value >= 0:
                self.usage_tokens.labels(kind).inc(value)

    def watch_router(self, router: "Router", registry: CollectorRegistry | None = None) -> None:
        from picker.observability.kvmetrics import KVCollector
        (registry or self.registry).register(_RouterCollector(router))
        (registry or self.registry).register(KVCollector(router))


class _RouterCollector:
    def __init__(self, router: "Router"):
        self.router = router

    def collect(self):
        queue = GaugeMetricFamily("picker_endpoint_queue", "vllm:num_requests_waiting at last scrape",
                                  labels=["endpoint"])
        running = GaugeMetricFamily("picker_endpoint_running",
                                    "vllm:num_requests_running at last scrape", labels=["endpoint"])
        kv = GaugeMetricFamily("picker_endpoint_kv_usage", "KV-cache usage (0-1) at last scrape",
                               labels=["endpoint"])
        inflight = GaugeMetricFamily("picker_endpoint_inflight",
                                     "Requests sent by the picker and not yet finished",
                                     labels=["endpoint"])
        ready = GaugeMetricFamily("picker_endpoint_ready", "1 if the endpoint can be picked",
                                  labels=["endpoint"])
        for addr, e in list(self.router.endpoints.items()):
            inflight.add_metric([addr], e.inflight)
            ready.add_metric([addr], 1.0 if e.ready else 0.0)
            if e.metrics is not None:
                queue.add_metric([addr], e.metrics.waiting)
                running.add_metric([addr], e.metrics.running)
                kv.add_metric([addr], e.metrics.kv_usage)
        sat = GaugeMetricFamily("picker_pool_saturation",
                                "Mean endpoint saturation max(queue/threshold, kv/threshold)")
        sat.add_metric([], self.router.pool_saturation())
        return [queue, running, kv, inflight, ready, sat]



class LeaderCollector:
    """With --leader-election: whether this replica leads (ready for Envoy) and how often its
    leadership changed (acquired; lost: a renew failed or the Lease was taken; released: on
    shutdown). Read from the elector (`elector()`, None before it starts) when Prometheus
    scrapes."""

    def __init__(self, elector: Callable[[], Any]):
        self.elector = elector

    def collect(self):
        elector = self.elector()
        leader = GaugeMetricFamily("picker_leader",
                                   "1 if this replica holds the pool's Lease and serves Envoy")
        leader.add_metric([], 1.0 if elector is not None and elector.is_leader() else 0.0)
        changes = CounterMetricFamily("picker_leader_transitions",
                                      "Changes of this replica's leadership", labels=["change"])
        for change, count in (elector.transitions.items() if elector is not None else ()):
            changes.add_metric([change], count)
        return [leader, changes]


class FailoverCollector:
    """Whether this replica answers Envoy (the acting leader), whether it does so without holding
    the Lease (after a takeover, or riding an API outage through), its takeovers by reason and the
    other replicas by state (failover.py, peer_link.py). Read when Prometheus scrapes; a replica
    without --leader-election and --peers acts whenever it serves, and has no peers."""

    def __init__(self, failover: Callable[[], Any], peers: Callable[[], list],
                 serving: Callable[[], bool]):
        self.failover = failover
        self.peers = peers
        self.serving = serving

    def collect(self):
        from picker.failover import GONE, LEFT, LIVE, SILENT, TAKEOVER_REASONS
        f = self.failover()
        acting = GaugeMetricFamily("picker_acting_leader",
                                   "1 if this replica answers SERVING to Envoy's health check "
                                   "(the one Envoy sends its streams to)")
        acting.add_metric([], 1.0 if self.serving() else 0.0)
        unleased = GaugeMetricFamily("picker_acting_without_lease",
                                     "1 if this replica acts without holding the Lease (it took "
                                     "over and waits for the Lease, or the API server is "
                                     "unreachable)")
        without = f is not None and f.role.acting and f.role.without_lease
        unleased.add_metric([], 1.0 if without else 0.0)
        takeovers = CounterMetricFamily("picker_failovers",
                                        "Times this replica took over from a leader, by why: "
                                        "handover (it left), leader_gone (its process died), "
                                        "leader_silent (it hung)", labels=["reason"])
        for reason in TAKEOVER_REASONS:
            takeovers.add_metric([reason], f.takeovers[reason] if f is not None else 0)
        peers = GaugeMetricFamily("picker_peers", "Other replicas on the peer link, by state",
                                  labels=["state"])
        states = [p.status for p in self.peers()]
        for state in (LIVE, SILENT, LEFT, GONE):
            peers.add_metric([state], states.count(state))
        return [acting, unleased, takeovers, peers]

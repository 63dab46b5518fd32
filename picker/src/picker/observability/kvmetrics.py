"""Metrics of precise prefix routing, read from the router when Prometheus scrapes: the
tokenizer's state and, per endpoint followed, its KV-events sync state and counters (kept by the
signals process's tracker, signals/kvstate.py)."""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from picker.signals.kvstate import STAT_FIELDS

if TYPE_CHECKING:
    from picker.core import Router

_COUNTERS = {  # stat field -> (metric name, help)
    "batches": ("picker_kv_event_batches", "KV-event batches applied"),
    "events": ("picker_kv_events", "KV events received in applied batches"),
    "unknown": ("picker_kv_unknown_events", "KV events of an unknown kind, skipped"),
    "malformed": ("picker_kv_malformed_batches", "KV-event batches that did not fit vLLM's schema"),
    "gaps": ("picker_kv_sequence_gaps", "Sequence gaps in an endpoint's KV events"),
    "replays": ("picker_kv_replays", "Replays asked from an endpoint's replay socket"),
    "dropped": ("picker_kv_dropped_messages",
                "KV-event messages dropped (flooding, out of sync, backlog full)"),
    "overflow": ("picker_kv_overflow_blocks",
                 "Blocks dropped because more were tracked than the endpoint's KV capacity"),
    "late_joins": ("picker_kv_late_joins", "Syncs that started after the engine's start (its "
                   "replay buffer no longer held it, or no replay socket)"),
}
_STATES = ("loaded", "missing", "mismatch")


class KVCollector:
    def __init__(self, router: "Router"):
        self.router = router

    def collect(self):
        precise = self.router.precise
        tok = GaugeMetricFamily("picker_kv_tokenizer",
                                "1 for the state of the model's tokenizer (precise prefix routing "
                                "needs 'loaded')", labels=["state"])
        if precise is None:  # --no-precise-prefix
            tok.add_metric(["off"], 1.0)
            return [tok]
        for state in _STATES:
            tok.add_metric([state], 1.0 if precise.state == state else 0.0)
        untok = CounterMetricFamily("picker_kv_untokenizable_requests",
                                    "Requests routed on the approximate index because they could "
                                    "not be tokenized as the engine does")
        untok.add_metric([], precise.untokenizable)
        in_sync = GaugeMetricFamily("picker_kv_endpoint_in_sync",
                                    "1 if the endpoint's KV events are in sync (precise routing), "
                                    "0 if it falls back to the approximate index", labels=["endpoint"])
        blocks = GaugeMetricFamily("picker_kv_endpoint_blocks", "Blocks the endpoint's engine holds, "
                                   "as its KV events tell", labels=["endpoint"])
        lag = GaugeMetricFamily("picker_kv_event_lag_seconds", "Receive time minus the engine's "
                                "timestamp of its last KV-event batch", labels=["endpoint"])
        fallback = GaugeMetricFamily("picker_kv_endpoints_fallback", "Endpoints routed on the "
                                     "approximate index, by reason", labels=["reason"])
        counters = {f: CounterMetricFamily(n, h, labels=["endpoint"]) for f, (n, h) in _COUNTERS.items()}
        endpoints = self.router.endpoints
        reasons: Counter = Counter()
        for addr, (ok, reason, n, stats) in list(precise.status.items()):
            if addr not in endpoints:
                continue
            in_sync.add_metric([addr], 1.0 if ok else 0.0)
            blocks.add_metric([addr], n)
            if not ok:
                reasons[reason or "unknown"] += 1
            values = dict(zip(STAT_FIELDS, stats))
            lag.add_metric([addr], values["lag"])
            for f, fam in counters.items():
                fam.add_metric([addr], values[f])
        for addr in endpoints:
            if addr not in precise.status:
                reasons["no_events"] += 1
        for reason, n in sorted(reasons.items()):
            fallback.add_metric([reason], n)
        return [tok, untok, in_sync, blocks, lag, fallback, *counters.values()]

"""vLLM's /metrics exposition rendered from an Engine (pure: no server, no global registry).

Names, types and labels follow vLLM's PrometheusStatLogger (vllm/v1/metrics/loggers.py): every
family carries `model_name` (the first served model name, as vLLM does) and `engine="0"`.
The family set follows vLLM 0.32 where the picker and the load tests read it (checked against
the real server by tests/conformance): `vllm:kv_cache_usage_perc` only, without the
`vllm:gpu_cache_usage_perc` that vLLM removed after deprecating it in 0.9.

    render_metrics(engine, "qwq")                    # full page, what GET /metrics returns
    render_metrics(engine, "qwq", gauges_only=True)  # gauges + cache_config_info only (fast path
                                                     # for the routing lab's scrapes)
"""

from __future__ import annotations

import functools

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)
from prometheus_client.utils import floatToGoString

from local.sim.engine import Engine, Histogram

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LABELS = ("model_name", "engine")


def _gauge(name: str, doc: str, labels: tuple, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=LABELS)
    g.add_metric(labels, value)
    return g


def _counter(name: str, doc: str, labels: tuple, value: float) -> CounterMetricFamily:
    c = CounterMetricFamily(name, doc, labels=LABELS)
    c.add_metric(labels, value)
    return c


def _histogram(name: str, doc: str, labels: tuple, hist: Histogram) -> HistogramMetricFamily:
    h = HistogramMetricFamily(name, doc, labels=LABELS)
    h.add_metric(labels, hist.cumulative(), hist.sum)
    return h


def cache_config_labels(engine: Engine) -> dict[str, str]:
    p = engine.engine_model
    return {
        "block_size": str(p.block_size),
        "cache_dtype": p.cache_dtype,
        "enable_prefix_caching": str(p.enable_prefix_caching),
        "gpu_memory_utilization": str(p.gpu_memory_utilization),
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(p.num_gpu_blocks),
        "num_gpu_blocks_override": "None",
        "sliding_window": "None",
    }


def gauge_families(model_name: str, running: int, waiting: int, kv_usage: float,
                   cache_config: dict[str, str]):
    lv = (model_name, "0")
    yield _gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                 lv, running)
    yield _gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                 lv, waiting)
    yield _gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                 lv, kv_usage)
    info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                             labels=list(cache_config) + ["engine"])
    info.add_metric(list(cache_config.values()) + ["0"], 1.0)
    yield info


class _Families:
    def __init__(self, families):
        self.families = families

    def collect(self):
        return self.families


def render_gauges(model_name: str, running: int, waiting: int, kv_usage: float,
                  cache_config: dict[str, str]) -> str:
    """The gauge part of the page from recorded values (the lab renders past snapshots): the
    text prometheus_client renders, from a template it rendered once per model and cache
    config, with the three values formatted as it formats them (~20x faster)."""
    template = _gauge_template(model_name, tuple(cache_config.items()))
    return template.format(floatToGoString(running), floatToGoString(waiting),
                           floatToGoString(kv_usage))


def render_gauges_slow(model_name: str, running: int, waiting: int, kv_usage: float,
                       cache_config: dict[str, str]) -> str:
    """render_gauges through prometheus_client's registry and exposition every time."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(gauge_families(model_name, running, waiting, kv_usage,
                                                    cache_config))))
    return generate_latest(registry).decode()


# Values no gauge page shows otherwise (running, waiting, KV usage): their text in a rendered
# page marks where the values go.
_SENTINELS = (7777777.0, 6666666.0, 0.5555555555)


@functools.lru_cache(maxsize=256)
def _gauge_template(model_name: str, cache_config: tuple) -> str:
    text = render_gauges_slow(model_name, *_SENTINELS, dict(cache_config))
    text = text.replace("{", "{{").replace("}", "}}")
    for i, value in enumerate(_SENTINELS):
        mark = floatToGoString(value)
        if text.count(mark) != 1:
            raise AssertionError(f"gauge template: {mark} appears {text.count(mark)} times")
        text = text.replace(mark, "{%d}" % i)
    return text


class EngineCollector:
    """prometheus_client collector reading one engine's state at collect time."""

    def __init__(self, engine: Engine, model_name: str, gauges_only: bool = False,
                 lora: tuple[int, float] | None = None):
        self.engine = engine
        self.labels = (model_name, "0")
        self.gauges_only = gauges_only
        self.lora = lora

    def collect(self):
        e, lv = self.engine, self.labels
        yield from gauge_families(lv[0], len(e.running), len(e.waiting), e.kv_cache_usage(),
                                  cache_config_labels(e))
        if self.lora is not None:
            yield lora_family(*self.lora)
        if self.gauges_only:
            return
        yield _counter("vllm:prefix_cache_queries",
                       "Prefix cache queries, in terms of number of queried tokens.", lv,
                       e.prefix_cache_queries)
        yield _counter("vllm:prefix_cache_hits",
                       "Prefix cache hits, in terms of number of cached tokens.", lv,
                       e.prefix_cache_hits)
        yield _counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                       lv, e.num_preemptions)
        yield _counter("vllm:prompt_tokens", "Number of prefill tokens processed.", lv,
                       e.prompt_tokens)
        yield _counter("vllm:generation_tokens", "Number of generation tokens processed.", lv,
                       e.generation_tokens)
        success = CounterMetricFamily("vllm:request_success",
                                      "Count of successfully processed requests.",
                                      labels=LABELS + ("finished_reason",))
        for reason in ("stop", "length", "abort"):
            success.add_metric(lv + (reason,), e.request_success.get(reason, 0))
        yield success
        yield _histogram("vllm:time_to_first_token_seconds",
                         "Histogram of time to first token in seconds.", lv, e.ttft)
        yield _histogram("vllm:inter_token_latency_seconds",
                         "Histogram of inter-token latency in seconds.", lv, e.itl)
        yield _histogram("vllm:e2e_request_latency_seconds",
                         "Histogram of e2e request latency in seconds.", lv, e.e2e)


def lora_family(max_loras: int, timestamp: float) -> GaugeMetricFamily:
    """vLLM's `vllm:lora_requests_info` (only with --enable-lora): no model_name or engine label,
    the adapters running and waiting comma-joined, the value the Unix time of the update. The
    simulator serves no adapters, so both lists are empty."""
    info = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                             labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
    info.add_metric([str(max_loras), "", ""], timestamp)
    return info


def render_metrics(engine: Engine, model_name: str, gauges_only: bool = False,
                   lora: tuple[int, float] | None = None) -> str:
    """`lora`: (max_loras, Unix time) to render vllm:lora_requests_info, as vLLM with LoRA on."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine, model_name, gauges_only, lora))
    return generate_latest(registry).decode()

"""Parse the vLLM Prometheus text exposition into the few signals the picker uses.

Only the families below are parsed. Lines are pre-filtered by metric name before they reach
prometheus_client's parser, because a vLLM /metrics page is mostly histogram buckets the picker
never reads and parsing all of them would dominate the scrape cost.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"
CACHE_CONFIG = "vllm:cache_config_info"
LORA_INFO = "vllm:lora_requests_info"
WANTED = frozenset({WAITING, RUNNING, KV_USAGE, KV_USAGE_OLD, CACHE_CONFIG, LORA_INFO})


class MetricsParseError(ValueError):
    """The text is not a usable vLLM metrics page."""


@dataclass(frozen=True, slots=True)
class ModelServerMetrics:
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0               # 0..1
    models: frozenset[str] = frozenset()  # model_name labels seen
    block_size: int | None = None       # tokens per KV block
    num_gpu_blocks: int | None = None
    lora_max: int | None = None
    lora_running: frozenset[str] = field(default_factory=frozenset)
    lora_waiting: frozenset[str] = field(default_factory=frozenset)

    @property
    def kv_capacity_tokens(self) -> int | None:
        if self.block_size and self.num_gpu_blocks:
            return self.block_size * self.num_gpu_blocks
        return None


def _metric_name(line: str) -> str:
    end = len(line)
    for sep in ("{", " "):
        i = line.find(sep)
        if 0 <= i < end:
            end = i
    return line[:end]


def _filter_lines(text: str) -> str:
    keep = []
    for line in text.splitlines():
        if line.startswith("vllm:") and _metric_name(line) in WANTED:
            keep.append(line)
    return "\n".join(keep) + "\n"


def _int_label(labels: dict[str, str], key: str) -> int | None:
    try:
        return int(float(labels[key]))
    except (KeyError, ValueError):
        return None


def _adapters(value: str | None) -> frozenset[str]:
    return frozenset(a for a in (value or "").split(",") if a)


def parse_vllm_metrics(text: str | bytes) -> ModelServerMetrics:
    """Parse one /metrics page. Raises MetricsParseError if no vLLM load gauge is present."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    waiting = running = 0.0
    kv_new: list[float] = []
    kv_old: list[float] = []
    models: set[str] = set()
    block_size = num_blocks = None
    lora: tuple[float, dict[str, str]] | None = None
    seen_load = False
    try:
        families = list(text_string_to_metric_families(_filter_lines(text)))
    except ValueError as exc:  # prometheus_client raises ValueError on malformed lines
        raise MetricsParseError(f"malformed metrics text: {exc}") from exc
    for family in families:
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, sample.value
            if name != LORA_INFO and "model_name" in labels:
                models.add(labels["model_name"])
            if name == WAITING:
                waiting += value
                seen_load = True
            elif name == RUNNING:
                running += value
                seen_load = True
            elif name == KV_USAGE:
                kv_new.append(value)
            elif name == KV_USAGE_OLD:
                kv_old.append(value)
            elif name == CACHE_CONFIG:
                block_size = _int_label(labels, "block_size") or block_size
                num_blocks = _int_label(labels, "num_gpu_blocks") or num_blocks
            elif name == LORA_INFO and (lora is None or value >= lora[0]):
                lora = (value, labels)  # value is an update timestamp: the newest series wins
    if not seen_load:
        raise MetricsParseError(f"no {WAITING} or {RUNNING} in metrics text")
    kv = kv_new or kv_old
    lora_labels = lora[1] if lora else {}
    return ModelServerMetrics(
        waiting=waiting,
        running=running,
        kv_usage=min(1.0, max(0.0, max(kv))) if kv else 0.0,
        models=frozenset(models),
        block_size=block_size,
        num_gpu_blocks=num_blocks,
        lora_max=_int_label(lora_labels, "max_lora") if lora else None,
        lora_running=_adapters(lora_labels.get("running_lora_adapters")),
        lora_waiting=_adapters(lora_labels.get("waiting_lora_adapters")),
    )

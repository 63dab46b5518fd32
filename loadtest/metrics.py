"""Per-request samples and vLLM serving-benchmark statistics.

Definitions follow vLLM's benchmark (`vllm/benchmarks/serve.py`, `endpoint_request_func.py`):

- TTFT: time from sending the request to the first streamed chunk with non-empty ``choices``
  (its text may be empty).
- ITL: every gap between successive ``choices`` chunks, flattened over all requests (one value
  per chunk, not per token).
- E2EL (latency): last ``choices`` chunk minus send time; the trailing usage-only chunk does not
  count.
- TPOT: (E2EL - TTFT) / (output_tokens - 1), only for requests with more than one output token.
- Tokens: ``usage.completion_tokens`` / ``usage.prompt_tokens`` from the server (the workload's
  own count is used only when the server sent no usage).
- Statistics over successful requests only: np.mean, np.median, np.std (ddof 0),
  np.percentile (linear), reported in ms; an empty list gives 0 like vLLM.

Times inside a sample are seconds; ``start`` is a wall-clock epoch (so samples from several
processes line up), the durations are measured with a monotonic clock.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")   # vLLM's --goodput keys (values in ms)
DEFAULT_PERCENTILES = (99.0,)                # vLLM's --metric-percentiles default

# The result fields (of summarize()) that tables and benchmarks compare, in table order. Every
# list of benchmark metrics names its subset from this one (summary_keys).
RESULT_KEYS = ("mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "mean_itl_ms",
               "output_throughput", "total_token_throughput", "request_throughput", "duration",
               "completed", "failed")


def summary_keys(*names: str) -> tuple[str, ...]:
    """The named fields, in RESULT_KEYS order; a name not in RESULT_KEYS is an error."""
    unknown = [n for n in names if n not in RESULT_KEYS]
    if unknown:
        raise ValueError(f"not result keys: {', '.join(unknown)}; known: {', '.join(RESULT_KEYS)}")
    return tuple(k for k in RESULT_KEYS if k in names)


HEADLINE_KEYS = summary_keys("mean_ttft_ms", "p99_ttft_ms", "output_throughput")  # the article's
REPORT_KEYS = summary_keys(*HEADLINE_KEYS, "median_ttft_ms", "mean_tpot_ms", "duration")  # BENCHMARKS.md


def percent_change(base: float | None, other: float | None) -> float | None:
    """The change from base to other in % (-25.0: a quarter less); None without a finite, non-zero base."""
    if base is None or other is None or base == 0 or not np.isfinite(base):
        return None
    return (other - base) / base * 100


def parse_percentiles(text: str | list | tuple | None) -> tuple[float, ...]:
    """'50,90,99' or '50 90 99' -> (50.0, 90.0, 99.0); '' -> the default (99)."""
    if text is None or text == "" or text == []:
        return DEFAULT_PERCENTILES
    items = text if isinstance(text, (list, tuple)) else str(text).replace(",", " ").split()
    try:
        values = tuple(float(p) for p in items)
    except ValueError:
        raise ValueError(f"percentiles must be numbers like 50,90,99, got {text!r}") from None
    if any(not 0 < p < 100 for p in values):
        raise ValueError(f"percentiles must be between 0 and 100, got {text!r}")
    return values


def parse_goodput(text: str | list | None) -> dict[str, float]:
    """vLLM's --goodput: 'ttft:500 tpot:50' (or comma separated) -> {'ttft': 500.0, ...} in ms."""
    items = text if isinstance(text, list) else str(text or "").replace(",", " ").split()
    slos: dict[str, float] = {}
    for item in items:
        key, sep, value = item.partition(":")
        if not sep or key not in GOODPUT_METRICS:
            raise ValueError(f"goodput SLO {item!r} must be KEY:MS with KEY one of "
                             f"{', '.join(GOODPUT_METRICS)} (e.g. ttft:500 tpot:50)")
        try:
            slos[key] = float(value)
        except ValueError:
            raise ValueError(f"goodput SLO {item!r}: {value!r} is not a number of ms") from None
        if slos[key] <= 0:
            raise ValueError(f"goodput SLO {item!r} must be > 0 ms")
    return slos


def meets_slos(sample: "RequestSample", slos: dict[str, float]) -> bool:
    """A successful request whose TTFT, TPOT and E2EL are within the SLOs (ms), as in vLLM."""
    if not sample.success:
        return False
    values = {"ttft": sample.ttft, "tpot": sample.tpot or 0.0, "e2el": sample.latency}
    return all(values[key] * 1000.0 <= limit for key, limit in slos.items())


@dataclass
class RequestSample:
    start: float                 # send time, epoch seconds
    success: bool
    ttft: float = 0.0            # s, first chunk with non-empty choices
    latency: float = 0.0         # s, E2EL: last choices chunk
    itl: list[float] = field(default_factory=list)  # s, gaps between choices chunks
    prompt_tokens: int = 0       # usage.prompt_tokens (else the workload's count)
    output_tokens: int = 0       # usage.completion_tokens (else the number of choices chunks)
    end: float = 0.0             # epoch seconds when the request finished (success or not)
    error: str = ""              # reason of a failure
    target: str = ""             # e.g. "8080" (the port the request went to)
    endpoint: str = ""           # "/v1/completions" or "/v1/chat/completions"
    group: str = ""              # workload group / tenant
    client: str = ""             # the client that sent it (loadtest/clients.py)

    @property
    def tpot(self) -> float | None:
        if not self.success or self.output_tokens <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


class StreamTimer:
    """Turns the parsed SSE events of one streamed OpenAI response into a RequestSample.

    Feed every decoded JSON event with the monotonic time it arrived; call finish() at the end.
    """

    def __init__(self, start_wall: float, start_mono: float, *, prompt_tokens: int = 0,
                 target: str = "", endpoint: str = "", group: str = "", client: str = ""):
        self.start_wall = start_wall
        self.start_mono = start_mono
        self.sample = RequestSample(start=start_wall, success=False, prompt_tokens=prompt_tokens,
                                    target=target, endpoint=endpoint, group=group, client=client)
        self.chunks = 0
        self._last: float | None = None
        self._usage: dict | None = None

    def on_event(self, data: dict, now_mono: float) -> None:
        if data.get("choices"):
            if self._last is None:
                self.sample.ttft = now_mono - self.start_mono
            else:
                self.sample.itl.append(now_mono - self._last)
            self._last = now_mono
            self.chunks += 1
        if isinstance(data.get("usage"), dict):
            self._usage = data["usage"]

    def finish(self, now_mono: float, error: str = "") -> RequestSample:
        s = self.sample
        s.end = self.start_wall + (now_mono - self.start_mono)
        if not error and self._last is None:
            error = "stream ended without any choices chunk"
        if error:
            s.success, s.error = False, error
            return s
        s.success = True
        s.latency = self._last - self.start_mono
        usage = self._usage or {}
        s.output_tokens = int(usage.get("completion_tokens") or self.chunks)
        if usage.get("prompt_tokens") is not None:
            s.prompt_tokens = int(usage["prompt_tokens"])
        return s


def _pkey(p: float) -> str:
    return f"p{int(p) if int(p) == p else p}"


def _stats(name: str, values_s: list[float], percentiles: Iterable[float]) -> dict:
    ms = np.asarray(values_s, dtype=float) * 1000.0
    if ms.size == 0:
        ms = np.zeros(1)  # vLLM: np.mean(x or 0) -> 0 for no values
    out = {f"mean_{name}_ms": float(np.mean(ms)), f"median_{name}_ms": float(np.median(ms)),
           f"std_{name}_ms": float(np.std(ms))}
    for p in percentiles:
        out[f"{_pkey(p)}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def metric_values(samples: Iterable[RequestSample]) -> dict[str, list[float]]:
    """Raw per-metric values in seconds over successful requests (ITL flattened)."""
    ok = [s for s in samples if s.success]
    return {
        "ttft": [s.ttft for s in ok],
        "tpot": [s.tpot for s in ok if s.tpot is not None],
        "itl": [gap for s in ok for gap in s.itl],
        "e2el": [s.latency for s in ok],
    }


def run_duration(samples: list[RequestSample]) -> float:
    """Wall time from the first dispatch to the last completion."""
    if not samples:
        return 0.0
    return max(s.end for s in samples) - min(s.start for s in samples)


def summarize(samples: list[RequestSample], duration: float | None = None, *,
              percentiles: Iterable[float] = DEFAULT_PERCENTILES, goodput: dict | None = None,
              details: bool = False, **meta) -> dict:
    """vLLM result dict (same field names as `vllm bench serve --save-result`).

    duration: benchmark wall time in seconds (default: first dispatch to last completion).
    goodput: SLOs in ms ({'ttft': 500, 'tpot': 50}): adds request_goodput (req/s meeting all).
    details: also include the per-request lists (input_lens, output_lens, ttfts, itls,
    latencies, start_times, errors) as vLLM does. meta: extra fields copied in first
    (e.g. model_id, num_prompts, max_concurrency, request_rate, label).
    """
    samples = list(samples)
    if duration is None:
        duration = run_duration(samples)
    ok = [s for s in samples if s.success]
    total_in = sum(s.prompt_tokens for s in ok)
    total_out = sum(s.output_tokens for s in ok)
    dur = duration if duration > 0 else float("nan")
    result = dict(meta)
    result.update({
        "duration": float(duration),
        "completed": len(ok),
        "failed": len(samples) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur,
        "output_throughput": total_out / dur,
        "total_token_throughput": (total_in + total_out) / dur,
    })
    if goodput:
        result["goodput_slos_ms"] = dict(goodput)
        result["request_goodput"] = sum(meets_slos(s, goodput) for s in ok) / dur
    values = metric_values(samples)
    for name in METRICS:
        result.update(_stats(name, values[name], percentiles))
    if details:
        result.update({
            "input_lens": [s.prompt_tokens for s in samples],
            "output_lens": [s.output_tokens if s.success else 0 for s in samples],
            "ttfts": [s.ttft for s in samples],
            "itls": [s.itl for s in samples],
            "latencies": [s.latency for s in samples],
            "start_times": [s.start for s in samples],
            "errors": [s.error for s in samples],
        })
    return result


def error_counts(samples: Iterable[RequestSample]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for s in samples:
        if not s.success:
            counts[s.error] = counts.get(s.error, 0) + 1
    return counts


def error_kind(reason: str) -> str:
    """A failure reason without its details: `HTTP 503 (queue_timeout)` of `HTTP 503
    (queue_timeout): waited 6.1s ...`; other reasons with the numbers of their message replaced
    by N (`HTTP 429: local_rate_limited`, `timeout after Ns`)."""
    head, sep, message = reason.partition(": ")
    if head.startswith("HTTP ") and "(" in head:
        return head
    if not head.startswith("HTTP "):
        head, sep, message = "", "", reason
    return (head + sep + re.sub(r"\d+(\.\d+)?", "N", message))[:80]


def error_kinds(samples: Iterable[RequestSample]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for s in samples:
        if not s.success:
            kind = error_kind(s.error)
            counts[kind] = counts.get(kind, 0) + 1
    return counts


def by_client(samples: list[RequestSample], **stats) -> dict[str, dict]:
    """Each client's own summary and failures by kind ({} when no sample names a client)."""
    clients = sorted({s.client for s in samples if s.client})
    out = {}
    for c in clients:
        own = [s for s in samples if s.client == c]
        out[c] = summarize(own, **stats) | {"errors_by_kind": error_kinds(own)}
    return out


def write_samples(path: str | Path, samples: Iterable[RequestSample]) -> None:
    """Raw samples, one JSON object per line (JSONL)."""
    with open(path, "w", encoding="utf-8") as f:
        for s in samples:
            f.write(json.dumps(asdict(s)) + "\n")


def read_samples(path: str | Path) -> list[RequestSample]:
    with open(path, encoding="utf-8") as f:
        return [RequestSample(**json.loads(line)) for line in f if line.strip()]


def save_run(stem: str | Path, samples: list[RequestSample], duration: float | None = None,
             **meta) -> dict:
    """Write <stem>.json (vLLM result fields + error counts) and <stem>.samples.jsonl."""
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    stats = {"percentiles": meta.pop("percentiles", None) or DEFAULT_PERCENTILES,
             "goodput": meta.pop("goodput", None)}
    result = summarize(samples, duration, **stats, **meta)
    result["errors_by_reason"] = error_counts(samples)
    targets = sorted({s.target for s in samples})
    if len(targets) > 1:  # one run over several ports: each port's own numbers too
        result["by_target"] = {t: summarize([s for s in samples if s.target == t], **stats)
                               for t in targets}
    clients = by_client(samples, **stats)
    if clients:
        result["by_client"] = clients
    text = json.dumps(result, indent=2) + "\n"
    (stem.parent / (stem.name + ".json")).write_text(text, encoding="utf-8")
    write_samples(stem.parent / (stem.name + ".samples.jsonl"), samples)
    return result

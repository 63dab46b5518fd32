"""Scrape the serving endpoints' vLLM /metrics during a run (running, waiting, KV usage)."""
from __future__ import annotations

import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

# name -> series; for KV usage the vLLM >= 0.9 name wins, vllm:gpu_cache_usage_perc (older vLLM,
# e.g. the article's v0.7.2) is used only when the new one is absent (servers may expose both).
GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_usage",
}
FALLBACKS = {"vllm:gpu_cache_usage_perc": "kv_usage"}
SERIES = ("running", "waiting", "kv_usage")


def parse_load(text: str) -> dict[str, float]:
    """Requests summed over label sets (engines); KV usage averaged over them."""
    found: dict[str, list[float]] = {}
    fallback: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        key, into = GAUGES.get(family.name), found
        if key is None:
            key, into = FALLBACKS.get(family.name), fallback
        if key is None:
            continue
        for sample in family.samples:
            if sample.name == family.name:
                into.setdefault(key, []).append(float(sample.value))
    for key, values in fallback.items():
        found.setdefault(key, values)
    return {key: (sum(v) / len(v) if key == "kv_usage" else sum(v))
            for key, v in found.items() if v}


def metrics_url(endpoint: str) -> str:
    base = endpoint if "://" in endpoint else f"http://{endpoint}"
    return base if base.rstrip("/").endswith("/metrics") else base.rstrip("/") + "/metrics"


def scrape(endpoint: str, timeout: float = 2.0) -> dict[str, float]:
    with urllib.request.urlopen(metrics_url(endpoint), timeout=timeout) as resp:
        return parse_load(resp.read().decode("utf-8", errors="replace"))


class LoadRecorder:
    """Polls every endpoint; `rows` holds {t, endpoint, running, waiting, kv_usage} (t: epoch s).

    `poll_forever` is meant to run in its own greenlet/thread; a failed scrape records the
    error once per endpoint and keeps going.
    """

    def __init__(self, endpoints: list[str], interval: float = 1.0, sleep=time.sleep):
        self.endpoints = list(endpoints)
        self.interval = interval
        self.sleep = sleep
        self.rows: list[dict] = []
        self.errors: dict[str, str] = {}

    def poll_once(self) -> None:
        for endpoint in self.endpoints:
            now = time.time()
            try:
                values = scrape(endpoint)
            except Exception as err:  # down or not vLLM: note it, keep polling the others
                self.errors.setdefault(endpoint, f"{type(err).__name__}: {err}")
                continue
            self.rows.append({"t": now, "endpoint": endpoint,
                              **{k: values.get(k) for k in SERIES}})

    def poll_forever(self) -> None:
        while True:
            self.poll_once()
            self.sleep(self.interval)

    def is_idle(self) -> bool:
        """True when every reachable endpoint reports nothing running or waiting."""
        idle = True
        for endpoint in self.endpoints:
            try:
                values = scrape(endpoint)
            except Exception:
                continue
            if (values.get("running") or 0) + (values.get("waiting") or 0) > 0:
                idle = False
        return idle

"""/metrics: the families the picker and the load tests read are on real vLLM 0.32's page with
the labels they expect, the simulator emits the same ones (and nothing vLLM has removed), the
picker's parser reads the real page, and its router routes on it."""

from __future__ import annotations

import json
import random
import threading
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadtest.scrape import FALLBACKS
from picker.core import RequestInfo, Router, RouterSettings
from picker.scheduling.profile import load_profile
from picker.signals.metrics import (CACHE_CONFIG, KV_USAGE, LORA_INFO, RUNNING, WAITING,
                                    parse_vllm_metrics)
from tests.conformance.conftest import sample_text
from tests.conformance.exchanges import words

# What the picker reads (picker/src/picker/signals/metrics.py) and the labels it needs.
PICKER_LABELS = {WAITING: {"model_name"}, RUNNING: {"model_name"}, KV_USAGE: {"model_name"},
                 CACHE_CONFIG: {"block_size", "num_gpu_blocks"}}    # vLLM 0.32: no model_name here
LORA_LABELS = {"max_lora", "running_lora_adapters", "waiting_lora_adapters"}


def fetch(address: str, path: str = "/metrics", body: dict | None = None) -> str:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"http://{address}{path}", data=data,
                                 headers={"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(req, timeout=300) as r:
        return r.read().decode()


def label_sets(text: str) -> dict[str, set[str]]:
    """family name (as exposed: counters with _total) -> the label names of its samples."""
    out: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            name = s.name if fam.type != "histogram" else fam.name
            out.setdefault(name, set()).update(k for k in s.labels if k != "le")
    return out


def check_picker_families(text: str) -> None:
    labels = label_sets(text)
    for family, needed in PICKER_LABELS.items():
        assert family in labels, f"{family} missing"
        assert needed <= labels[family], f"{family}: labels {sorted(labels[family])}"


def test_recorded_vllm_pages_carry_what_the_picker_reads():
    for name in ("metrics-vllm-0.32.0.txt", "metrics-vllm-0.32.0-running.txt",
                 "metrics-vllm-0.32.0-blocks64.txt"):
        check_picker_families(sample_text(name))
    lora = label_sets(sample_text("metrics-vllm-0.32.0-lora.txt"))
    assert lora[LORA_INFO] == LORA_LABELS      # no model_name: the parser must not need one


def test_picker_parses_recorded_vllm_pages():
    idle = parse_vllm_metrics(sample_text("metrics-vllm-0.32.0.txt"))
    assert (idle.running, idle.waiting, idle.kv_usage) == (0, 0, 0)
    assert idle.models == {"qwq"} and idle.block_size == 128 and idle.num_gpu_blocks == 4096
    running = parse_vllm_metrics(sample_text("metrics-vllm-0.32.0-running.txt"))
    assert running.running == 4 and running.kv_usage > 0
    assert parse_vllm_metrics(sample_text("metrics-vllm-0.32.0-blocks64.txt")).num_gpu_blocks == 64
    lora = parse_vllm_metrics(sample_text("metrics-vllm-0.32.0-lora.txt"))
    assert lora.lora_max == 2 and lora.models == {"qwq"}


def test_simulator_families_are_vllm_families_with_the_same_labels(sim):
    """The session's simulator runs with --max-loras 2, as the LoRA recording's vLLM did."""
    fetch(sim, "/v1/completions", {"model": "qwq", "prompt": words(20), "max_tokens": 2})
    real = label_sets(sample_text("metrics-vllm-0.32.0.txt"))
    real.update(label_sets(sample_text("metrics-vllm-0.32.0-lora.txt")))
    simulated = label_sets(fetch(sim))
    assert simulated[LORA_INFO] == LORA_LABELS
    assert parse_vllm_metrics(fetch(sim)).lora_max == 2
    assert set(simulated) - set(real) == set(), "the simulator emits families vLLM 0.32 has not"
    check_picker_families(fetch(sim))
    for family in simulated:
        if family == CACHE_CONFIG:      # vLLM's CacheConfig has many more fields
            assert simulated[family] <= real[family]
        else:
            assert simulated[family] == real[family], family
    # the load tests' scrape reads vLLM >= 0.9's KV gauge, the old name only as a fallback
    assert set(FALLBACKS) & set(simulated) == set()


def _router(addresses: list[str]) -> Router:
    router = Router(load_profile("default"), clock=lambda: 1000.0, rng=random.Random(1),
                    settings=RouterSettings())
    router.set_endpoints(addresses)
    return router


def _pick(router: Router) -> str:
    body = json.dumps({"model": "qwq", "prompt": words(50), "max_tokens": 8}).encode()
    return router.decide(RequestInfo("/v1/completions", {}, body, None)).endpoint


def test_picker_routes_on_live_vllm_metrics(live_vllm):
    """Pages of the live server idle and with 4 long requests decoding: the router sends a
    request to the endpoint whose page is idle, whichever of two addresses that is."""
    address = live_vllm.address
    idle = fetch(address)
    check_picker_families(idle)
    assert parse_vllm_metrics(idle).models == {"qwq"}
    assert parse_vllm_metrics(idle).block_size == 128      # the CPU backend's block size

    def long_request(i: int) -> None:
        fetch(address, "/v1/completions", {"model": "qwq", "prompt": words(30, 500 + 40 * i),
                                           "max_tokens": 600, "ignore_eos": True})

    threads = [threading.Thread(target=long_request, args=(i,), daemon=True) for i in range(4)]
    for t in threads:
        t.start()
    busy, busiest = None, 0.0
    for _ in range(400):
        page = fetch(address)
        load = parse_vllm_metrics(page)
        if load.running + load.waiting > busiest:
            busy, busiest = page, load.running + load.waiting
        if busiest >= 4 or not any(t.is_alive() for t in threads):
            break
    for t in threads:
        t.join(timeout=300)
    assert busy is not None and busiest >= 2, "never saw the requests running"
    assert parse_vllm_metrics(busy).kv_usage > 0

    for idle_addr, busy_addr in (("10.0.0.1:8000", "10.0.0.2:8000"),
                                 ("10.0.0.2:8000", "10.0.0.1:8000")):
        router = _router(["10.0.0.1:8000", "10.0.0.2:8000"])
        router.on_scrape_ok(idle_addr, idle)
        router.on_scrape_ok(busy_addr, busy)
        assert _pick(router) == idle_addr


def test_picker_reads_live_vllm_models(live_vllm):
    from picker.signals.models import parse_models
    assert parse_models(fetch(live_vllm.address, "/v1/models")) == {"qwq"}


@pytest.mark.parametrize("page", ["metrics-vllm-0.32.0-running.txt"])
def test_lab_gauges_parse_like_the_real_page(page):
    """The routing lab feeds the picker pages rendered from recorded states (render_gauges):
    parsed, they give what the real page of the same state gives."""
    from local.sim.metrics import render_gauges
    real = parse_vllm_metrics(sample_text(page))
    cache = {"block_size": str(real.block_size), "num_gpu_blocks": str(real.num_gpu_blocks)}
    rendered = parse_vllm_metrics(render_gauges("qwq", int(real.running), int(real.waiting),
                                                real.kv_usage, cache))
    assert (rendered.running, rendered.waiting, rendered.kv_usage, rendered.block_size,
            rendered.num_gpu_blocks, rendered.models) == \
        (real.running, real.waiting, real.kv_usage, real.block_size, real.num_gpu_blocks, real.models)

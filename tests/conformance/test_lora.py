"""LoRA on real vLLM 0.32's CPU build: one server started with the tiny model's adapter
(`--enable-lora --lora-modules tiny-lora=DIR`), checked for what the picker relies on:
/v1/models lists the adapter under its base model, a completion naming it is served,
`vllm:lora_requests_info` carries the labels the picker's parser reads (the adapter among the
running ones while a request uses it), the picker routes an adapter request to that endpoint and
refuses an unknown adapter with 404, and the simulator started with --max-loras exposes the same
family with the same labels.

Module scope: the server (about 2 GB) stops when this module's tests end. Over 30 s: starting vLLM's
CPU build with LoRA on (torch import, model and adapter load; 60-90 s on 2 busy cores) falls to the
first test, and a completion through the adapter runs the CPU's LoRA kernels (~35 s).
"""

from __future__ import annotations

import json
import random
import threading

import pytest
from prometheus_client.parser import text_string_to_metric_families

from local import vllm_server
from local.tinymodel.lora import DEFAULT_DIR as ADAPTER_DIR, adapter_ready
from picker.core import RequestInfo, Router, RouterSettings
from picker.errors import PickerError
from picker.scheduling.profile import load_profile
from picker.signals.metrics import LORA_INFO, parse_vllm_metrics
from picker.signals.models import parse_models
from tests.conformance.conftest import MAX_MODEL_LEN, _start_sim, free_port
from tests.conformance.exchanges import words
from tests.conformance.test_metrics import LORA_LABELS, fetch

ADAPTER = "tiny-lora"
MAX_LORAS = 2
LORA_FLAGS = ("--enable-lora", "--lora-modules", f"{ADAPTER}={ADAPTER_DIR}",
              "--max-loras", str(MAX_LORAS), "--max-lora-rank", "8")


@pytest.fixture(scope="module")
def lora_vllm(tmp_path_factory) -> str:
    if not vllm_server.available() or not adapter_ready(ADAPTER_DIR):
        pytest.skip("real vLLM, the tiny model and its adapter are built by make vllm")
    server = vllm_server.VllmServer(port=free_port(), max_model_len=MAX_MODEL_LEN,
                                    extra_args=LORA_FLAGS)
    log = tmp_path_factory.mktemp("vllm-lora") / "vllm.log"
    proc = vllm_server.start(server, log)
    try:
        vllm_server.wait_ready(server, proc, log, timeout=600)
        yield server.address
    finally:
        vllm_server.stop(proc)


@pytest.fixture(scope="module")
def lora_sim(tmp_path_factory) -> str:
    yield from _start_sim(tmp_path_factory, "--max-loras", str(MAX_LORAS),
                          "--served-model-name", ADAPTER)


def lora_series(text: str) -> list[dict[str, str]]:
    return [s.labels for fam in text_string_to_metric_families(text) if fam.name == LORA_INFO
            for s in fam.samples]


def completion(address: str, model: str, max_tokens: int = 8, **extra) -> dict:
    return json.loads(fetch(address, "/v1/completions",
                            {"model": model, "prompt": words(20), "max_tokens": max_tokens, **extra}))


def test_models_list_the_adapter_under_its_base(lora_vllm):
    text = fetch(lora_vllm, "/v1/models")
    by_id = {m["id"]: m for m in json.loads(text)["data"]}
    assert set(by_id) == {"qwq", ADAPTER}
    assert by_id[ADAPTER]["parent"] == "qwq"
    assert by_id[ADAPTER]["root"] == str(ADAPTER_DIR)
    assert by_id["qwq"]["parent"] is None
    assert parse_models(text) == {"qwq", ADAPTER}    # the picker counts the adapter as served


def test_a_completion_naming_the_adapter_is_served(lora_vllm):
    base = completion(lora_vllm, "qwq", ignore_eos=True, temperature=0, logprobs=1)
    tuned = completion(lora_vllm, ADAPTER, ignore_eos=True, temperature=0, logprobs=1)
    assert tuned["model"] == ADAPTER and base["model"] == "qwq"
    assert tuned["usage"]["completion_tokens"] == 8
    # the adapter's weights are applied: the same prompt's log-probabilities differ (the random
    # model repeats one token either way, so the text alone may not)
    assert tuned["choices"][0]["logprobs"]["token_logprobs"] \
        != base["choices"][0]["logprobs"]["token_logprobs"]


def test_lora_info_names_the_running_adapter_and_the_picker_reads_it(lora_vllm):
    # vLLM 0.32 has no sample of the family before the engine's first scheduled request
    completion(lora_vllm, ADAPTER)
    idle = fetch(lora_vllm)
    series = lora_series(idle)
    assert series and all(set(s) == LORA_LABELS for s in series)
    assert parse_vllm_metrics(idle).lora_max == MAX_LORAS
    assert parse_vllm_metrics(idle).lora_running == frozenset()   # the newest series wins

    done = threading.Event()

    def long_request() -> None:
        try:
            completion(lora_vllm, ADAPTER, max_tokens=400, ignore_eos=True)
        finally:
            done.set()

    threading.Thread(target=long_request, daemon=True).start()
    busy = None
    while not done.is_set() and busy is None:
        page = fetch(lora_vllm)
        if ADAPTER in parse_vllm_metrics(page).lora_running:
            busy = page
    done.wait(timeout=300)
    assert busy is not None, "the adapter never showed among running_lora_adapters"
    assert parse_vllm_metrics(busy).lora_max == MAX_LORAS

    # The router: one endpoint with the adapter (this live page + its /v1/models), one without.
    router = Router(load_profile("default"), clock=lambda: 1000.0, rng=random.Random(1),
                    settings=RouterSettings())
    with_adapter, without = "10.0.0.1:8000", "10.0.0.2:8000"
    router.set_endpoints([without, with_adapter])
    router.on_scrape_ok(with_adapter, idle)
    router.on_models(with_adapter, parse_models(fetch(lora_vllm, "/v1/models")))
    router.on_scrape_ok(without, idle.replace(ADAPTER, "other"))
    router.on_models(without, {"qwq"})

    def decide(model: str):
        body = json.dumps({"model": model, "prompt": words(20), "max_tokens": 8}).encode()
        return router.decide(RequestInfo("/v1/completions", {}, body, None))

    for _ in range(5):
        assert decide(ADAPTER).endpoint == with_adapter
    with pytest.raises(PickerError) as err:
        decide("no-such-adapter")
    assert err.value.status == 404 and err.value.code == "model_not_found"


def test_simulator_lora_family_matches_live_vllm(lora_vllm, lora_sim):
    """Idle, after a request: vLLM keeps one series per label combination it has seen (the
    picker takes the newest), the simulator has only the idle one; labels and limits agree."""
    completion(lora_vllm, ADAPTER)
    completion(lora_sim, ADAPTER)
    real_page, sim_page = fetch(lora_vllm), fetch(lora_sim)
    real, simulated = lora_series(real_page), lora_series(sim_page)
    assert real and len(simulated) == 1
    assert all(set(s) == LORA_LABELS for s in real + simulated)
    assert {s["max_lora"] for s in real + simulated} == {str(MAX_LORAS)}
    assert {"max_lora": str(MAX_LORAS), "running_lora_adapters": "",
            "waiting_lora_adapters": ""} in real
    assert simulated[0]["running_lora_adapters"] == simulated[0]["waiting_lora_adapters"] == ""
    real_parsed, sim_parsed = parse_vllm_metrics(real_page), parse_vllm_metrics(sim_page)
    assert (sim_parsed.lora_max, sim_parsed.lora_running, sim_parsed.lora_waiting) \
        == (real_parsed.lora_max, real_parsed.lora_running, real_parsed.lora_waiting)

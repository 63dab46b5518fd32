"""Real vLLM behind the real gateway: two groups of vLLM's CPU build serving the tiny model
(`make vllm`), the picker in front of them with the model's tokenizer, Envoy Gateway + Envoy.
Both listeners serve completions and chat, streamed or not, to the official OpenAI client; the
picker decides every llm-gw request, reads the engines' metrics and follows their KV events.
Over 30 s: the first test waits for two real vLLM servers to start (CPU build, ~45 s on 2 cores)."""

from __future__ import annotations

import time
import urllib.request

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from local import vllm_server
from local.stack import Stack, StackConfig
from local.stack.config import VLLM_STARTUP_TIMEOUT
from local.stack.demo import REAL_ENGINE_CALLS, real_engine_call
from local.stack.processes import free_ports
from tests.conformance.exchanges import words
from tests.e2e.conftest import picker_decisions
from tests.e2e.test_e2e_down import assert_down_stops_everything

pytestmark = pytest.mark.e2e
MAX_TOKENS = 12


def picker_samples(stack: Stack, name: str) -> dict[str, float]:
    """endpoint (or state) label -> value of one of the picker's own metrics."""
    url = f"http://{stack.config.host}:{stack.config.picker_metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {next(iter(s.labels.values()), ""): s.value
            for f in text_string_to_metric_families(text) for s in f.samples if s.name == name}


def picker_total(stack: Stack, name: str) -> float:
    """The sum of one of the picker's metrics over all its labels."""
    url = f"http://{stack.config.host}:{stack.config.picker_metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    if not vllm_server.available():
        pytest.skip("real vLLM is not installed (make vllm)")
    ports = free_ports(8)   # KV events on the stack's default ports (18101..), as its simulators
    config = StackConfig(name="vllm", engine="vllm", run_root=tmp_path_factory.mktemp("runs"),
                         groups=2, speedup=1.0, sim_ports=ports[6:], http_port=ports[0],
                         llm_port=ports[1], picker_grpc_port=ports[2], picker_health_port=ports[3],
                         picker_metrics_port=ports[4], picker_outcomes_port=ports[5], picker_args=["--log-level", "debug"],
                         startup_timeout=VLLM_STARTUP_TIMEOUT)
    stack = Stack(config).start()
    try:
        yield stack
    finally:
        stack.stop()


def test_both_listeners_serve_real_vllm_through_the_gateway(stack):
    engines = {s.address for s in stack.topology.sims}
    decided_before = len(picker_decisions(stack))
    for listener, port in stack.listener_ports().items():
        client = openai.OpenAI(base_url=f"http://{stack.config.host}:{port}/v1",
                               api_key=stack.api_key() or "none", max_retries=0, timeout=120)
        assert {m.id for m in client.models.list().data} == {"qwq"}
        for api, stream in REAL_ENGINE_CALLS:
            assert real_engine_call(client, "qwq", api, stream, MAX_TOKENS) == MAX_TOKENS, \
                (listener, api, stream)
    decisions = picker_decisions(stack)[decided_before:]
    assert len(decisions) >= len(REAL_ENGINE_CALLS) and set(decisions) <= engines


def test_picker_reads_the_engines_and_follows_their_kv_events(stack):
    engines = {s.address for s in stack.topology.sims}
    assert picker_samples(stack, "picker_kv_tokenizer").get("loaded") == 1.0
    client = openai.OpenAI(base_url=f"http://{stack.config.host}:{stack.llm_port}/v1",
                           api_key=stack.api_key() or "none", max_retries=0, timeout=120)
    long_prompt = words(300, 700)                 # two full 128-token KV blocks
    assert client.completions.create(model="qwq", prompt=long_prompt, max_tokens=2).usage.prompt_tokens == 300
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        in_sync = picker_samples(stack, "picker_kv_endpoint_in_sync")
        blocks = picker_samples(stack, "picker_kv_endpoint_blocks")
        if set(in_sync) == engines and all(in_sync.values()) and sum(blocks.values()) > 0:
            break
        time.sleep(0.5)
    assert in_sync == {e: 1.0 for e in engines}, "the picker is not in sync with every engine"
    assert sum(blocks.values()) > 0, "no KV block reached the picker"
    assert set(picker_samples(stack, "picker_endpoint_kv_usage")) == engines


# Two applications whose answers differ tenfold, told apart only by their API keys (the edge
# names them in x-client-id): the same prompt lengths, the same max_tokens cap. The tiny model's
# answer ends where the test wants it: min_tokens holds its end-of-sequence token back, and a
# logit bias on that token makes it come right after (the picker reads neither field).
ANSWERS = {"chat-app": 20, "reasoner-app": 200}
LEARN_REQUESTS = 12          # alternating: 6 answers of each application, then the forecasts
CAP = 400
EOS_BIAS = {"2": 100}        # token 2: the tiny model's <|im_end|> (local/tinymodel/tokenizer.py)


def test_the_picker_learns_two_applications_answer_lengths_apart(stack):
    from tests.e2e.conftest import json_lines
    clients = {name: openai.OpenAI(base_url=f"http://{stack.config.host}:{stack.llm_port}/v1",
                                   api_key=stack.api_key(name), max_retries=0, timeout=120)
               for name in ANSWERS}

    def ask(name: str, i: int) -> int:
        answer = clients[name].completions.create(
            model="qwq", prompt=words(60, 1000 + 97 * i), max_tokens=CAP, temperature=0.0,
            logit_bias=EOS_BIAS, extra_body={"min_tokens": ANSWERS[name]})
        return answer.usage.completion_tokens

    for i in range(LEARN_REQUESTS):
        name = list(ANSWERS)[i % 2]
        assert ask(name, i) in (ANSWERS[name], ANSWERS[name] + 1)
    # the last outcomes reach the picker at Envoy's next access-log flush (every second)
    deadline = time.monotonic() + 15
    while picker_total(stack, "picker_outcomes_total") < LEARN_REQUESTS \
            and time.monotonic() < deadline:
        time.sleep(0.25)
    decided = len([r for r in json_lines(stack.proc("picker").log) if r.get("msg") == "decision"])
    for i, name in enumerate(ANSWERS):
        ask(name, LEARN_REQUESTS + i)
    latest = [r for r in json_lines(stack.proc("picker").log) if r.get("msg") == "decision"][decided:]
    forecasts = {r["client"]: r["forecast_median"] for r in latest}
    assert set(forecasts) == set(ANSWERS), latest
    assert 10 <= forecasts["chat-app"] <= 40, forecasts
    assert 100 <= forecasts["reasoner-app"] <= 400, forecasts
    assert forecasts["reasoner-app"] >= 5 * forecasts["chat-app"], forecasts


def test_make_down_stops_both_vllm_servers_and_their_engine_cores(stack):
    """Last in this module: `python -m local.stack down` from another process (as `make down` after
    `make up ENGINE=vllm`) stops every process of the stack, vLLM's engine cores included, and
    frees the engines' ports (the module's fixture then has nothing left to stop)."""
    ports = [s.port for s in stack.topology.sims] + list(stack.listener_ports().values())
    assert_down_stops_everything(stack.config.name, stack.config.run_root, ports)


"""The picker against a real vLLM: its CPU build serving the tiny model (`make vllm`; skipped
where it is not installed). The picker's subscriber follows the engine's own KV-cache events, and
its own tokenization (the model directory's tokenizer.json and chat template) must give the
engine's token ids: every full block of a chat or completion prompt the engine computed is
matched by the picker's own chain."""
from __future__ import annotations

import json
import random
import time
import urllib.request

import pytest

from helpers import free_ports
from local import vllm_server
from picker.kvsubscriber import KVSubscriber, resolve_source
from picker.scheduling.kvindex import PreciseIndex
from picker.signals.kvstate import KVTracker, chain_hashes
from picker.tokenizer import ModelTokenizer
from vllm_engines import running, tiny_model_dir

pytestmark = pytest.mark.server  # starts other programs as processes


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    pub, replay, port = free_ports(3)
    server = vllm_server.VllmServer(port=port, kv_events_port=pub, kv_replay_port=replay,
                                    model_dir=model_dir)
    with running([server], tmp_path_factory):
        yield server


def _post(server, path: str, body: dict) -> dict:
    req = urllib.request.Request(f"http://{server.address}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def test_the_pickers_tokens_and_blocks_are_the_engines(engine, model_dir):
    with urllib.request.urlopen(f"http://{engine.address}/kv_event_sources", timeout=10) as r:
        pub, replay = resolve_source(engine.address, json.loads(r.read()))
    sub = KVSubscriber(KVTracker())
    sub.start()
    index = PreciseIndex()
    tok = ModelTokenizer(model_dir)
    rng = random.Random(3)

    def words(n):  # digits and letters: where tokenizer pipelines differ
        return " ".join(f"w{rng.randrange(3000)}" for _ in range(n))
    requests = [
        ("/v1/chat/completions", {"model": "qwq", "max_tokens": 2, "messages": [
            {"role": "system", "content": words(200)}, {"role": "user", "content": words(100)}]}),
        ("/v1/chat/completions", {"model": "qwq", "max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "text", "text": words(150)},
                                         {"type": "text", "text": words(50)}]}]}),
        ("/v1/completions", {"model": "qwq", "max_tokens": 2, "prompt": words(300)}),
    ]
    try:
        sub.subscribe(engine.address, pub, replay)
        deadline = time.monotonic() + 30
        while not index.in_sync(engine.address) and time.monotonic() < deadline:
            index.apply(sub.take()[0])
            time.sleep(0.05)
        assert index.in_sync(engine.address)
        for path, body in requests:
            usage = _post(engine, path, body)["usage"]
            ids = tok.request_tokens(path, body)
            assert len(ids) == usage["prompt_tokens"], path
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                index.apply(sub.take()[0])
                bs = index.block_size.get(engine.address)
                chain = chain_hashes(ids, bs) if bs else []
                if chain and index.match(chain).get(engine.address) == len(chain):
                    break
                time.sleep(0.1)
            assert chain and index.match(chain) == {engine.address: len(chain)}, path
    finally:
        sub.stop()

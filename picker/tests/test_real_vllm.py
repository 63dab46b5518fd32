"""The picker against a real vLLM: its CPU build serving the tiny model (`make vllm`; skipped
where it is not installed). The picker's subscriber follows the engine's own KV-cache events, and
its own tokenization (the model directory's tokenizer.json and chat template) must give the
engine's token ids: every full block of a chat or completion prompt the engine computed is
matched by the picker's own chain."""
from __future__ import annotations

import json
import random
import shutil
import socket
import time
import urllib.request
from pathlib import Path

import pytest

from picker.kvsubscriber import KVSubscriber, resolve_source
from picker.scheduling.kvindex import PreciseIndex
from picker.signals.kvstate import KVTracker, chain_hashes
from picker.tokenizer import ModelTokenizer

vllm_server = pytest.importorskip("local.vllm_server")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The built model with the tokenizer the current builder writes (a cache built by an older
    builder may hold another tokenizer.json; vLLM and the picker both read this directory)."""
    if not vllm_server.available():
        pytest.skip("real vLLM is not installed (make vllm)")
    from local.tinymodel.tokenizer import write_tokenizer
    out = tmp_path_factory.mktemp("tiny-model")
    for f in Path(vllm_server.MODEL_DIR).iterdir():
        if f.name not in ("tokenizer.json", "tokenizer_config.json") and f.is_file():
            (out / f.name).symlink_to(f.resolve())
    write_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    server = vllm_server.VllmServer(port=_port(), kv_events_port=_port(), kv_replay_port=_port(),
                                    model_dir=model_dir)
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    proc = vllm_server.start(server, log)
    try:
        vllm_server.wait_ready(server, proc, log)
        yield server
    finally:
        vllm_server.stop(proc)
        shutil.rmtree(log.parent, ignore_errors=True)


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
